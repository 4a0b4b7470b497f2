"""The ``capacity`` scheduler extension: capacity reallocation between agent roles (Nalar Algorithm 2).

Agent roles are Dask worker resources named ``role:<name>`` (the prefix is
``kvstate.scheduling.capacity.resource-prefix``); a task asks for one with
``resources={"role:tester": 1}``, a worker offers units of it (``--resources
role:tester=1``). The extension is installed by default and does nothing until workers
offer such resources. Every capacity interval, off the critical path (on the global
control loop), for each role ``v`` over the last ``window``:

* ``mu_bar_v``: the measured per-unit service rate (completions over busy unit-seconds,
  from the compute start/stop times workers send with every finished task, plus the
  time the role's running calls have run so far, so a change of call length shows
  before those calls finish);
* ``demand_v``: the work offered to the role, in units: role calls submitted per second
  over ``mu_bar_v``, plus the work already waiting for it (ready tasks over
  ``mu_bar_v``, spread over one window) so a burst is cleared, not just carried;
* ``u_v = demand_v / R_v``: its utilisation with ``R_v`` units. Nalar's normalised
  capacity is ``x_v = R_v * mu_bar_v / p_v = lambda / u_v`` (``p_v`` visits per request,
  ``lambda`` requests per second), so the lowest ``x_v`` is the highest ``u_v``.

Nalar moves one unit per ``K`` intervals from a donor to the bottleneck. From an even
split that takes many intervals (three moves of two seconds each to reach a developer-
heavy split on the SWE workflow), during which the queue grows. So this controller
computes a whole split (:func:`~.queueing.target_split`) and moves every unit it differs by at
once. The split is not Nalar's ``max min_v x_v`` (evening utilisations), which is blind
to how many units share a load: when a few seconds of an analyst workflow's summarizer
calls dipped to 0.6 units, it gave their second unit to the analysts (61% / 60% busy
against 72% / 30%), though one summarizer queues fifteen times as long as two. It is the
split with the fewest calls expected to wait
(Erlang C, :mod:`~dask_kvstate.plugins.scheduler.queueing`), which is Nalar's split
wherever a role is overloaded and the best static split of a grid search on the SWE,
router and analyst workflows. Units move to it when the same target has held for
``K`` consecutive intervals (default 1: on a workload whose mix flips every 10 s,
K = 2 cost 15-25% of the average latency in single runs) and :func:`~.queueing.worth_moving`:
it cuts the expected queue by more than ``epsilon``, and still does with each role's
arrivals ``noise-sigmas`` standard errors against the move (:func:`~.queueing.against_the_move`).
That second test keeps a burst of requests, which passes by itself, from moving a unit
that the next seconds need back; a change in how long calls take, which the running
calls show at once, moves units within about a window.

Moving a unit: a worker is picked that can give up a unit of the donor role without
stranding a donor task (an idle unit first; a worker's last unit only with no donor
task on it). The scheduler stops counting
that unit first (no new donor work is sent there for it), the worker's
``kvstate-scheduling`` plugin updates its own resources, then the scheduler adds the
receiver's unit and dispatches ``no-worker`` tasks that fit it. Work already queued on
the receiver's other workers reaches the new unit by stealing.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, defaultdict, deque
from time import perf_counter, time

from distributed.diagnostics.plugin import SchedulerPlugin

from dask_kvstate import config
from dask_kvstate.plugins.scheduler.queueing import against_the_move, congestion, target_split, worth_moving
from dask_kvstate.protocol import CAPACITY_EXTENSION, CAPACITY_TOPIC, HINTS_EXTENSION, SESSIONS_EXTENSION, SET_RESOURCES

logger = logging.getLogger("dask_kvstate")


class CapacityController(SchedulerPlugin):
    """Scheduler side of capacity reallocation (installed by ``kvs.install`` when enabled)."""

    name = CAPACITY_EXTENSION
    idempotent = True

    def __init__(
        self,
        interval=None,
        persistence: int | None = None,
        epsilon: float | None = None,
        noise_sigmas: float | None = None,
        prefix: str | None = None,
        limits: dict | None = None,
        window=None,
    ):
        self.interval_s = config.get_seconds("scheduling.capacity.interval", interval)
        self.window_s = config.get_seconds("scheduling.capacity.window", window)
        self.k = int(config.get("scheduling.capacity.persistence") if persistence is None else persistence)
        self.epsilon = float(config.get("scheduling.capacity.epsilon") if epsilon is None else epsilon)
        self.sigmas = float(config.get("scheduling.capacity.noise-sigmas") if noise_sigmas is None else noise_sigmas)
        self.prefix = config.get("scheduling.capacity.resource-prefix") if prefix is None else prefix
        self.limits = dict(config.get("scheduling.capacity.limits") if limits is None else limits)
        if self.k < 1 or self.epsilon < 0 or self.sigmas < 0 or not self.prefix or self.window_s < self.interval_s:
            raise ValueError(
                f"capacity settings out of range: persistence={self.k} epsilon={self.epsilon} "
                f"noise-sigmas={self.sigmas} "
                f"resource-prefix={self.prefix!r} window={self.window_s}s (at least interval={self.interval_s}s)"
            )
        for role, lim in self.limits.items():
            if not role.startswith(self.prefix):
                raise ValueError(f"capacity limit for {role!r}: roles are resources named {self.prefix}<name>")
            if lim.get("max") is not None and lim["max"] < lim.get("min", 1):
                raise ValueError(f"capacity limit for {role!r}: max {lim['max']} < min {lim.get('min', 1)}")

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.tracker = scheduler.plugins.get(SESSIONS_EXTENSION)
        assert self.tracker is not None, "the capacity extension needs the sessions extension registered first"
        self.counters: Counter[str] = Counter()
        self._done: defaultdict[str, list] = defaultdict(lambda: [0, 0.0])  # role -> [completions, busy s]
        self._visits: Counter[str] = Counter()  # role -> invocations submitted this interval
        # role -> the sessions (or, outside one, the keys) that submitted them: a request's
        # calls of a role come together (a fan-out), so arrivals are counted by request.
        self._sources: defaultdict[str, set] = defaultdict(set)
        self.role_of: dict = {}  # key -> its role, for tasks the scheduler holds
        # Role tasks in ``processing`` (sent to a worker), counted by transitions: a steal
        # moves a task between workers without one, but never in or out of processing.
        # Counting them per worker each pass cost 60-76 ms at 100,000 queued tasks.
        self.processing_of: Counter[str] = Counter()
        self.history: deque = deque(maxlen=max(1, round(self.window_s / self.interval_s)))  # (done, visits, sources, t)
        self.target: dict | None = None
        self.streak = 0
        self.moving: set[str] = set()  # workers with a move in flight
        self._moves: set[asyncio.Future] = set()
        self.moves: deque = deque(maxlen=100)
        self._moved_at: dict[tuple[str, str], float] = {}  # (from, to) -> time of its last move
        self.last: dict = {}
        self.latency: deque = deque(maxlen=1000)
        self._t_last = time()
        every = max(1, round(self.interval_s / self.tracker.loop.interval_s))
        self.tracker.loop.add("capacity", self.control, every=every)

    # -- telemetry -------------------------------------------------------------------
    def _roles(self, ts) -> list[str]:
        return [r for r in (ts.resource_restrictions or ()) if r.startswith(self.prefix)]

    def update_graph(self, scheduler, *, tasks=(), **kwargs) -> None:
        for key in tasks:
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state != "released" or not ts.resource_restrictions:
                continue
            roles = self._roles(ts)
            if not roles:
                continue
            # One role per task is what the controller counts (the first, if a task asks several).
            self.role_of[key] = roles[0]
            self._visits[roles[0]] += 1
            session = self.tracker.session_of(key)
            self._sources[roles[0]].add(key if session is None else session.id)

    def transition(self, key, start, finish, *args, startstops=None, **kwargs) -> None:
        if (start == "processing") == (finish == "processing"):
            if finish == "forgotten":
                self.role_of.pop(key, None)
            return
        r = self.role_of.get(key)
        if r is None:
            return
        self.processing_of[r] += 1 if finish == "processing" else -1
        if finish == "forgotten":
            del self.role_of[key]
        if start != "processing" or finish != "memory" or not startstops:
            return
        busy = sum(ss["stop"] - ss["start"] for ss in startstops if ss.get("action") == "compute")
        self._done[r][0] += 1
        self._done[r][1] += busy

    # -- the controller --------------------------------------------------------------
    def control(self) -> None:
        t0 = perf_counter()
        try:
            self._control()
        finally:
            self.latency.append(perf_counter() - t0)

    def _control(self) -> None:
        s = self.scheduler
        now = time()
        self.history.append((dict(self._done), dict(self._visits), dict(self._sources), now - self._t_last))
        self._t_last = now
        self._done.clear()
        self._visits.clear()
        self._sources = defaultdict(set)
        units: Counter[str] = Counter()
        ready: Counter[str] = Counter()
        role_of = self.role_of
        # Calls still running count with the time they have run so far (as of the worker's
        # last heartbeat): when a role's calls get longer, the mean of finished ones lags
        # by a whole call, the running ones show it at once (a censored-data estimate).
        running_s: defaultdict[str, float] = defaultdict(float)
        executing: Counter[str] = Counter()
        for ws in s.running:
            for ts, elapsed in ws.executing.items():
                r = role_of.get(ts.key)
                if r is not None:
                    running_s[r] += elapsed
                    executing[r] += 1
            for r, q in ws.resources.items():
                if r.startswith(self.prefix):
                    units[r] += q
        # Sent to workers and not running (``ws.executing`` is as of the last heartbeats):
        # queued behind busy units, or stranded on a worker that no longer offers the role.
        for r, n in self.processing_of.items():
            ready[r] += max(n - executing[r], 0)
        if not units:
            return  # no worker offers a role: nothing to reallocate
        # Tasks held by max-concurrency wait for a slot, not for want of units.
        held = getattr(s.plugins.get(HINTS_EXTENSION), "held_comp", {})
        for ts in s.unrunnable:
            r = role_of.get(ts.key)
            if r is not None and ts.key not in held:
                ready[r] += 1
        done: Counter[str] = Counter()
        busy: defaultdict[str, float] = defaultdict(float)
        visits: Counter[str] = Counter()
        span = 0.0
        sources: defaultdict[str, set] = defaultdict(set)
        for d, v, src, dt in self.history:
            for r, ids in src.items():
                sources[r] |= ids
            for r, (n, a) in d.items():
                done[r] += n
                busy[r] += a
            visits.update(v)
            span += dt
        roles = set(units) | set(visits)
        # Mean busy seconds per call: (finished + running so far) over finished calls.
        service = {r: (busy[r] + running_s[r]) / done[r] for r in roles if done[r] and busy[r] > 0}
        demand = {r: (visits[r] / max(span, 1e-9) + ready[r] / max(span, 1e-9)) * service[r] for r in service}
        # The chance part of a window's demand: the requests that called a role in it are
        # Poisson, so their count is off by its square root. A burst of requests passes by
        # itself; a change in how long calls take (measured with the running ones) does not,
        # and is what moves must follow at once, so only the arrivals are doubted.
        error = {r: demand[r] / math.sqrt(max(len(sources[r]), 1)) for r in service}
        self.last = {
            "units": dict(units),
            "ready": dict(ready),
            "service_s": service,
            "demand": demand,
            "demand_error": error,
            "utilisation": {r: demand[r] / units[r] if units[r] else None for r in demand},
        }
        # Until every role that is called has a measured service time, the split is unknown.
        if any(visits[r] or ready[r] for r in roles if r not in service):
            self.target, self.streak = None, 0
            return
        demand = {r: demand.get(r, 0.0) for r in units}
        total = int(sum(units.values()))
        target = target_split(demand, total, self.limits, dict(units))
        if target is None or target == dict(units):
            self.target, self.streak = target, 0
            self.last.update(target=target)
            return
        self.streak = self.streak + 1 if target == self.target else 1
        self.target = target
        held, moved = congestion(demand, units), congestion(demand, target)
        self.last.update(target=target, streak=self.streak, queue=held[0], predicted_queue=moved[0])
        self.last.update(peak=held[1], predicted_peak=moved[1])
        if self.streak < self.k or not worth_moving(held, moved, self.epsilon):
            return
        doubt = against_the_move(demand, error, units, target, self.sigmas)
        if not worth_moving(congestion(doubt, units), congestion(doubt, target), self.epsilon):
            self.counters["held_by_noise"] += 1
            return
        surplus = [r for r in units for _ in range(int(units[r] - target[r]))]
        deficit = [r for r in target for _ in range(int(target[r] - units[r]))]
        for donor, to in zip(surplus, deficit):
            # A unit that just moved the other way does not go back within a window: the
            # measurements it moved on have not yet seen the move (a fan-out's burst of
            # ready calls had units flip between two roles every second).
            if now - self._moved_at.get((to, donor), -math.inf) < self.window_s:
                self.counters["reversals_held"] += 1
                continue
            ws = self._donor_worker(donor)
            if ws is None:
                self.counters["no_free_unit"] += 1
                continue
            self.moving.add(ws.address)  # one move per worker at a time: the next pass does the rest
            task = asyncio.ensure_future(self._move(ws, donor, to, dict(self.last)))
            self._moves.add(task)  # a reference until done: the loop keeps only a weak one
            task.add_done_callback(self._moves.discard)

    def _donor_worker(self, donor: str):
        """A running worker that can give up a unit of ``donor`` without stranding a donor task.

        Best a worker with an idle donor unit (fewer donor calls running than units); else
        one keeping at least one donor unit, whose queued donor tasks still run there (or
        are stolen by the role's other workers). A worker's last unit goes only when no
        donor task is on it.
        """
        best, rank_best = None, None
        role_of = self.role_of
        for ws in self.scheduler.running:
            have = ws.resources.get(donor, 0)
            if have < 1 or ws.address in self.moving or ws.address not in self.tracker.announced:
                continue
            if have < 2 and any(role_of.get(ts.key) == donor for ts in ws.processing):
                continue
            running = sum(role_of.get(ts.key) == donor for ts in ws.executing)
            rank = (have - running, have, ws.address)
            if rank_best is None or rank[:2] > rank_best[:2] or (rank[:2] == rank_best[:2] and rank[2] < rank_best[2]):
                best, rank_best = ws, rank
        return best

    def _set(self, ws, role: str, quantity: float) -> None:
        ws.resources[role] = quantity
        self.scheduler.resources.setdefault(role, {})[ws.address] = quantity
        ws.used_resources.setdefault(role, 0)

    async def _move(self, ws, donor: str, to: str, why: dict) -> None:
        s = self.scheduler
        try:
            new_d, new_b = ws.resources.get(donor, 0) - 1, ws.resources.get(to, 0) + 1
            self._set(ws, donor, new_d)  # first: no more donor work is sent there
            try:
                await getattr(s.rpc(ws.address), SET_RESOURCES)(resources={donor: new_d, to: new_b})
            except Exception as e:
                self._set(ws, donor, new_d + 1)
                self.counters["failed_moves"] += 1
                logger.warning("kvstate capacity: moving %s -> %s on %s failed: %s", donor, to, ws.address, e)
                return
            if s.workers.get(ws.address) is not ws:
                return  # the worker left meanwhile
            self._set(ws, to, new_b)
            stimulus_id = f"kvstate-capacity-{time()}"
            s.transitions(s.bulk_schedule_unrunnable_after_adding_worker(ws), stimulus_id)
            move = {
                "kind": "move",
                "worker": ws.address,
                "from": donor,
                "to": to,
                # what the move was decided on, for reading the kvstate-capacity events
                **{k: why.get(k) for k in ("peak", "predicted_peak", "queue", "predicted_queue", "demand")},
                **{k: why.get(k) for k in ("demand_error", "ready")},
                "time": time(),
            }
            self.moves.append(move)
            self._moved_at[(donor, to)] = move["time"]
            self.counters["moves"] += 1
            s.log_event(CAPACITY_TOPIC, move)
        finally:
            self.moving.discard(ws.address)

    def stats(self) -> dict:
        from dask_kvstate.plugins.scheduler.control import latency_summary

        return {
            **dict(self.counters),
            "k": self.k,
            "last": self.last,
            "recent_moves": list(self.moves)[-20:],
            "latency": latency_summary(self.latency),
        }
