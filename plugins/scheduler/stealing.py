"""The ``stealing`` scheduler extension: KV-aware late-binding stealing (Nalar Algorithm 1) beside Dask's own.

Dask's ``WorkStealing`` balances plain tasks well: it prices a move by the bytes of the
inputs missing at the thief and only ever steals to idle workers. What it cannot see is
the KV behind a state (a ``KVStateRef`` is a few bytes to pickle, and serving it
elsewhere costs ``min(T_transfer, T_recompute)``), a session's affinity to the worker
holding its context, or a placement capped to a state's holders. So the work is split
by task, and every move still goes through Dask's ``move_task_request`` (steal-request
to the victim, which gives the task up only if it has not started, confirmed by
``steal-response``):

* **Tasks this extension owns**: consumers of a KV state the placement extension knows,
  tasks of a placement capped by ``placement.max-copies``, and tasks of components
  marked ``stateful`` in ``kvstate.scheduling.components``. Dask's stealing never sees
  them (its ``steal_time_ratio`` answers "not stealable" for them). Stateful ones keep
  session affinity: at submission they are routed to the worker that ran the session's
  earlier call to that component, and they are never migrated. The others move by
  Nalar's test each control interval: for every worker ``i`` with owned tasks waiting
  behind its threads, from the back of its queue (lowest priority first: those would
  wait longest, and a task at the front, about to start, is never asked for), a task
  moves to the compatible worker ``j`` with the smallest expected wait when
  :func:`migration_benefit` says so: the ready queues differ by more than ``alpha`` and
  ``W_i - W_j - C_mig > beta``. ``C_mig`` is Dask's transfer estimate for the inputs
  missing at ``j`` (``Scheduler.get_comm_cost``) plus the placement extension's cost
  of serving the KV at ``j`` (``min(T_transfer, T_recompute)``) less its cost at ``i``.
* **Everything else**: Dask's own ``WorkStealing.balance``, on its own timer as in stock
  Dask (its cost at 100,000 queued tasks, up to 150 ms a call, is Dask's, not the control
  loop's). Where the KV-aware policy has nothing to add, stealing is exactly Dask's. With
  ``distributed.scheduler.work-stealing: false`` the user asked for no stealing of
  plain tasks, and only owned tasks move (the stock protocol is borrowed for them).

**Late binding** (``late_binding.py``): a session's tasks with no restriction, no KV
input and inputs cheap to move wait on the scheduler for the first free thread, best
priority first, so none waits behind a long task while another worker idles and no
stealing is needed for them; a thread that finishes a session's awaited call is kept a
few milliseconds for the session's next call.
"""

from __future__ import annotations

import heapq
from collections import Counter

from distributed.diagnostics.plugin import SchedulerPlugin

from dask_kvstate import config
from dask_kvstate.plugins.scheduler.late_binding import LateBinding
from dask_kvstate.plugins.scheduler.liveness import heard_from
from dask_kvstate.plugins.scheduler.patches import PATCHES, STEAL_TIME_RATIO, STEALING, WORK_STEALING
from dask_kvstate.protocol import (
    PLACEMENT_ANNOTATION,
    PLACEMENT_EXTENSION,
    SESSIONS_EXTENSION,
    STEALING_EXTENSION,
    STEALING_TOPIC,
)
from dask_kvstate.session import component_of


def _priority(ts):
    return ts.priority


def _capped(ts) -> bool:
    """A placement capped by ``placement.max-copies``: the task stays on a copy's holder."""
    return bool(((ts.annotations or {}).get(PLACEMENT_ANNOTATION) or {}).get("capped"))


def migration_benefit(
    q_src: int, q_dst: int, w_src: float, w_dst: float, c_mig: float, *, alpha: float = 0.2, beta: float = 1e-3
) -> float | None:
    """Nalar's migration test: ``Δ = W_i - W_j - C_mig`` when moving pays, else None.

    ``q_*`` are ready-queue lengths (tasks waiting behind the worker's threads), ``w_*``
    expected queueing delays in seconds (of the task at ``i``, of a new task at ``j``)
    and ``c_mig`` the cost of moving it (inputs and KV missing at ``j``). A move is
    considered only when the queues differ by more than ``alpha`` of the source queue,
    and done only when the gain beats the cost by more than ``beta`` seconds.

    Examples
    --------
    >>> migration_benefit(10, 2, w_src=5.0, w_dst=1.0, c_mig=0.5)        # long queue, cheap move
    3.5
    >>> migration_benefit(10, 9, w_src=5.0, w_dst=1.0, c_mig=0.5) is None  # queues within alpha
    True
    >>> migration_benefit(10, 2, w_src=5.0, w_dst=1.0, c_mig=4.5) is None  # KV move eats the gain
    True
    """
    if q_src <= 0 or q_src - q_dst <= alpha * q_src:
        return None
    delta = w_src - w_dst - c_mig
    return delta if delta > beta else None


class LateBindingStealing(SchedulerPlugin):
    """Scheduler side of late-binding stealing (installed by ``kvs.install`` when enabled)."""

    name = STEALING_EXTENSION
    idempotent = True

    def __init__(
        self,
        alpha: float | None = None,
        beta: str | float | None = None,
        max_moves: int | None = None,
        components: dict | None = None,
        late_binding: float | None = None,
        late_binding_min_duration: str | float | None = None,
        continuation_wait: str | float | None = None,
    ):
        self.alpha = float(config.get("scheduling.stealing.alpha") if alpha is None else alpha)
        self.max_moves = int(config.get("scheduling.stealing.max-moves") if max_moves is None else max_moves)
        self.late_binding = float(
            config.get("scheduling.stealing.late-binding") if late_binding is None else late_binding
        )
        if self.late_binding < 0:
            raise ValueError(f"kvstate.scheduling.stealing.late-binding must be >= 0, got {self.late_binding!r}")
        self.late_binding_min_duration = config.get_seconds(
            "scheduling.stealing.late-binding-min-duration", late_binding_min_duration
        )
        if self.late_binding_min_duration < 0:
            raise ValueError(
                "kvstate.scheduling.stealing.late-binding-min-duration must be >= 0, "
                f"got {self.late_binding_min_duration!r}"
            )
        self.continuation_wait = config.get_seconds("scheduling.stealing.continuation-wait", continuation_wait)
        self.connect_timeout = config.get_seconds("transport.connect-timeout")  # a silent thief's limit
        if self.continuation_wait < 0:
            raise ValueError(
                f"kvstate.scheduling.stealing.continuation-wait must be >= 0, got {self.continuation_wait!r}"
            )
        hints = config.get("scheduling.components") if components is None else components
        if not 0 <= self.alpha < 1:
            raise ValueError(f"kvstate.scheduling.stealing.alpha must be in [0, 1), got {self.alpha!r}")
        self.beta = config.get_seconds("scheduling.stealing.beta", beta)
        if self.max_moves < 1:
            raise ValueError(f"kvstate.scheduling.stealing.max-moves must be >= 1, got {self.max_moves!r}")
        if not isinstance(hints, dict):
            raise ValueError(f"kvstate.scheduling.components must be a mapping, got {hints!r}")
        self.stateful = frozenset(name for name, h in hints.items() if (h or {}).get("stateful"))

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.tracker = scheduler.plugins.get(SESSIONS_EXTENSION)
        assert self.tracker is not None, "the stealing extension needs the sessions extension registered first"
        self.counters: Counter[str] = Counter()
        self.affinity: dict[tuple[str, str], str] = {}  # (session, stateful component) -> worker
        self.owned: set = set()  # processing tasks Dask's stealing was told to leave alone
        # distributed.scheduler.work-stealing is on: its balance keeps its own timer (the
        # same event loop, so never at the same time as a control pass), as in stock Dask.
        # Off: a WorkStealing is borrowed for its protocol only, for owned tasks. Dask has no
        # hook for "this task is not yours to steal"; its stealable sets are filled through
        # ``steal_time_ratio``, so owned tasks are kept out by wrapping it.
        self.fallback = scheduler.extensions.get("stealing") is not None
        PATCHES.install(
            scheduler,
            STEALING,
            {WORK_STEALING: self._borrow_stealing, STEAL_TIME_RATIO: self._wrap_steal_time_ratio},
            owner=self,
        )
        self.stock = scheduler.extensions["stealing"]
        self.late = LateBinding(
            scheduler,
            self.tracker,
            fraction=self.late_binding,
            min_duration=self.late_binding_min_duration,
            continuation_wait=self.continuation_wait,
            owns=self._owns,
        )
        self.late.install()
        self.tracker.on_end.append(self._forget_session)
        self.tracker.loop.add("stealing", self.balance)

    async def close(self) -> None:
        if self._forget_session in getattr(self.tracker, "on_end", []):
            self.tracker.on_end.remove(self._forget_session)
        late = getattr(self, "late", None)
        if late is not None:
            late.uninstall()
        if hasattr(self, "scheduler"):
            PATCHES.remove(self.scheduler, STEALING, owner=self)

    def _borrow_stealing(self, stock):
        """Dask's own ``WorkStealing``, or one made for its move protocol when config made none."""
        from distributed.stealing import WorkStealing

        return stock if stock is not None else WorkStealing(self.scheduler)

    def _wrap_steal_time_ratio(self, stock_ratio):
        """``stock_ratio``, answering "not stealable" for the tasks this extension owns."""

        def steal_time_ratio(ts):
            if self._owns(ts):
                self.owned.add(ts)
                return None, None
            return stock_ratio(ts)

        return steal_time_ratio

    def _owns(self, ts) -> bool:
        """A consumer of a known KV state, a capped placement, or a stateful component's task."""
        if self._stateful_session(ts) is not None or _capped(ts):
            return True
        placement = self.scheduler.plugins.get(PLACEMENT_EXTENSION)
        return placement is not None and any(d.key in placement.refs for d in ts.dependencies)

    # -- session affinity ----------------------------------------------------------------
    def _stateful_session(self, ts) -> tuple[str, str] | None:
        if not self.stateful:
            return None
        s = self.tracker.session_of(ts.key)
        comp = component_of(ts)
        return (s.id, comp) if s is not None and comp in self.stateful else None

    def update_graph(self, scheduler, *, tasks=(), **kwargs) -> None:
        if not self.stateful:
            return
        for key in tasks:
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state != "released" or ts.worker_restrictions:
                continue
            pair = self._stateful_session(ts)
            addr = self.affinity.get(pair) if pair else None
            if addr is not None and addr in scheduler.workers:
                ts.worker_restrictions = {addr}
                ts.loose_restrictions = True  # if that worker is gone, any other will do
                self.counters["affinity_routed"] += 1

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if start == "processing" and finish != "processing" and self.owned:
            self.owned.discard(self.scheduler.tasks.get(key))
        if finish != "processing" or not self.stateful:
            return
        ts = self.scheduler.tasks.get(key)
        pair = self._stateful_session(ts) if ts is not None else None
        if pair is not None and ts.processing_on is not None:
            self.affinity.setdefault(pair, ts.processing_on.address)

    def _forget_session(self, session) -> None:
        for pair in [p for p in self.affinity if p[0] == session.id]:
            del self.affinity[pair]

    # -- the policy ----------------------------------------------------------------------
    def _move_cost(self, ts, victim, thief) -> float:
        cost = self.scheduler.get_comm_cost(ts, thief)
        placement = self.scheduler.plugins.get(PLACEMENT_EXTENSION)
        if placement is not None:
            for dts in ts.dependencies:
                ref = placement.refs.get(dts.key)
                if ref is None:
                    continue
                at_j, at_i = placement.estimate(ref, thief.address), placement.estimate(ref, victim.address)
                if at_j is not None:
                    kv_j = min(at_j.t_transfer, at_j.t_recompute)
                    kv_i = min(at_i.t_transfer, at_i.t_recompute) if at_i is not None else 0.0
                    cost += max(kv_j - kv_i, 0.0)
        return cost

    def _thieves(self, ts, running, cache: dict) -> list:
        """Running workers that may run ``ts``, cached per restriction signature for one pass."""
        # A placement capped by ``placement.max-copies`` keeps the task on a copy's holder.
        capped = _capped(ts)
        sig = (
            frozenset(ts.worker_restrictions or ()),
            frozenset(ts.host_restrictions or ()),
            tuple(sorted((ts.resource_restrictions or {}).items())),
            ts.loose_restrictions,
            capped,
        )
        thieves = cache.get(sig)
        if thieves is None:
            # Loose restrictions (``allow_other_workers``, KV placement) are preferences: any
            # worker may take the task, the KV part of the move cost prices them. Resource
            # restrictions (agent roles) always hold.
            valid = None if ts.loose_restrictions and not capped else self.scheduler.valid_workers(ts)
            thieves = running if valid is None else [ws for ws in running if ws in valid]
            need = ts.resource_restrictions or {}
            thieves = cache[sig] = [ws for ws in thieves if all(ws.resources.get(r, 0) >= n for r, n in need.items())]
        return thieves

    def balance(self) -> None:
        """Owned tasks by Nalar's test (Dask's own balance moves the rest, on its own timer)."""
        s = self.scheduler
        self.counters["passes"] += 1
        self.counters["queued_seen"] = len(s.queued)  # late-bound by Dask's queue, see the module doc
        if self.owned:
            self._balance_owned()

    def _balance_owned(self) -> None:
        s = self.scheduler
        # never to a worker silent for long: one cut off looks idle (liveness.py)
        running = heard_from((ws for ws in s.running if ws.nthreads), len(s.workers), self.connect_timeout)
        if len(running) < 2:
            return
        in_flight = self.stock.in_flight
        waiting: dict = {}  # victim -> its owned tasks not started and not being moved
        for ts in self.owned:
            ws = ts.processing_on
            if ws is not None and ts not in ws.executing and ts not in ws.long_running and ts not in in_flight:
                waiting.setdefault(ws, []).append(ts)
        occ = {ws: ws.occupancy for ws in running}
        # Tasks beyond the worker's threads wait in its ready heap. (``ws.executing`` comes
        # with heartbeats and lags; a steal of a task that already started is refused by
        # the worker, so counting by threads is safe.)
        q = {ws: max(len(ws.processing) - len(ws.long_running) - ws.nthreads, 0) for ws in running}
        wait = lambda ws: occ[ws] / ws.nthreads
        thieves_by_sig: dict = {}
        moves = 0
        for victim in sorted((ws for ws in waiting if q.get(ws, 0) > 0), key=q.__getitem__, reverse=True):
            if moves >= self.max_moves:
                break
            # From the back of the queue, at most as many as wait behind the threads: the
            # front ones start next, and asking for them would only be refused.
            for ts in heapq.nlargest(min(q[victim], self.max_moves - moves), waiting[victim], key=_priority):
                if self._stateful_session(ts) is not None:
                    self.counters["affinity_kept"] += 1
                    continue
                thief = min(
                    (ws for ws in self._thieves(ts, running, thieves_by_sig) if ws is not victim),
                    key=wait,
                    default=None,
                )
                if thief is None:
                    continue
                duration = s._get_prefix_duration(ts.prefix)  # what WorkStealing uses too
                w_src = max(occ[victim] - duration, 0.0) / victim.nthreads
                delta = migration_benefit(
                    q[victim],
                    q[thief],
                    w_src,
                    wait(thief),
                    self._move_cost(ts, victim, thief),
                    alpha=self.alpha,
                    beta=self.beta,
                )
                if delta is None:
                    self.counters["kept"] += 1
                    break  # the rest of this queue waits no longer than this task: same verdict
                if self.stock.move_task_request(ts, victim, thief).startswith("steal-"):
                    occ[victim] -= duration
                    occ[thief] += duration
                    q[victim] -= 1
                    q[thief] += 1
                    moves += 1
                    self.counters["moves"] += 1
                    s.log_event(
                        STEALING_TOPIC,
                        {
                            "kind": "move",
                            "key": str(ts.key),
                            "victim": victim.address,
                            "thief": thief.address,
                            "gain": delta,
                        },
                    )

    def stats(self) -> dict:
        return {
            **dict(self.counters),
            "alpha": self.alpha,
            "beta": self.beta,
            "affinities": len(self.affinity),
            "owned": len(self.owned),
            "fallback_requests": sum(self.stock.metrics["request_count_total"].values()) if self.fallback else 0,
            **(self.late.stats() if hasattr(self, "late") else {"late_binding": self.late_binding}),
            "fallback": self.fallback,
            "stateful": sorted(self.stateful),
        }
