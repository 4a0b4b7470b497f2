"""The ``kvstate-lifecycle`` scheduler extension: offload, prefetch and invalidate KV by workflow progress.

Nalar 4.5 / Algorithm 3, AAFLOW+ 4.4. Every control interval (the sessions extension's
global loop), for each open session:

* **predict** the time until it is runnable again: over the tasks it waits on (its
  waiting tasks' unfinished dependencies), ``max(mean duration of that component -
  elapsed)``, a task not yet started adding the longest chain of mean durations through
  the unfinished tasks it waits on itself; the component means are this extension's own
  record of how long tasks of that component took on this scheduler (processing -> memory);
* **decide** with :func:`~dask_kvstate.plugins.scheduler.lifecycle_policy.lifecycle_action`:
  offload the session's KV to host or disk when it will idle longer than moving it out
  and back costs (rates measured on the worker per tier), prefetch it back when the
  prediction drops below restore time + margin (the configured margin, plus one standard
  deviation of the awaited components' measured durations: a mean alone makes every
  shorter-than-average run find its KV still out, plus one control interval: the pass
  after this one may come too late); a session whose KV task already runs
  with KV out gets it fetched at once; when a worker's device tier has less than the
  configured reserve free, offload the longest-idle suspended sessions first until it has;
* **act** by stream messages to the worker holding the KV (``kvstate-offload``,
  ``kvstate-prefetch``, handled by :mod:`dask_kvstate.plugins.worker.lifecycle`), and log each decision with its
  prediction, then its outcome (the move's seconds, and the real idle time once the
  session runs again) to ``scheduler.log_event("kvstate-lifecycle", ...)`` as
  ``{"kind": "offload"|"prefetch"|"invalidate", "phase": "decision"|"done"|"outcome", ...}``.

When a session ends (the sessions extension's ``on_end`` hook) every worker drops the
blocks held only for that session (``kvstate_lifecycle_invalidate``), and the bytes
freed / left / still shared with live sessions are logged. A call that fails (a busy or
reconnecting worker, a handler error) is retried, the wait doubling from Dask's
``distributed.comm.retry.delay.min`` to ``.max``, until the worker answers or leaves the
cluster (its blocks then went with it): a session hold never outlives its session on a
worker that stays. Only workers whose lifecycle half said hello are asked; one whose half
says goodbye (removed, or its worker closing, which tears plugins down while the worker
still counts as running) is asked nothing more, and its goodbye is answered once the calls
already on their way there are answered. A worker that answers as one without the handler
(``None``: Dask's answer to an unknown RPC) holds no session's KV: it is logged, counted
(``invalidations_unhandled``) and asked nothing more.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, defaultdict
from time import time
from typing import TYPE_CHECKING

import dask.config
from dask.utils import parse_timedelta
from distributed.diagnostics.plugin import SchedulerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler

from dask_kvstate import config
from dask_kvstate.plugins.scheduler.handshake import AnnouncedWorkers, serve_hello
from dask_kvstate.plugins.scheduler.lifecycle_history import TaskHistory, Walk
from dask_kvstate.plugins.scheduler.lifecycle_policy import (
    lifecycle_action,
    move_seconds,
    predict_idle,
    pressure_victims,
    uses_kv,
)
from dask_kvstate.protocol import (
    INVALIDATE,
    LIFECYCLE_DONE,
    LIFECYCLE_EXTENSION,
    LIFECYCLE_REPORT,
    LIFECYCLE_TOPIC,
    LIFECYCLE_WORKER_PLUGIN,
    OFFLOAD,
    PREFETCH,
    SESSIONS_EXTENSION,
)

logger = logging.getLogger("dask_kvstate")


class KVLifecycle(AnnouncedWorkers, SchedulerPlugin):
    """Scheduler side of the KV lifecycle (installed by ``kvs.install`` when ``kvstate.lifecycle.enabled``)."""

    scheduler: Scheduler  # set by start()

    name = LIFECYCLE_EXTENSION
    worker_half = LIFECYCLE_WORKER_PLUGIN
    idempotent = True

    def __init__(
        self, margin: str | float | None = None, reserve: float | None = None, latency: str | float | None = None
    ):
        self.margin_s = config.get_seconds("lifecycle.prefetch-margin", margin)
        self.latency_s = config.get_seconds("lifecycle.message-latency", latency)
        reserve = reserve if reserve is not None else config.get("lifecycle.device-reserve")
        if not isinstance(reserve, (int, float)) or not 0 <= reserve < 1:
            raise ValueError(f"kvstate.lifecycle.device-reserve must be a fraction in [0, 1), got {reserve!r}")
        self.reserve = float(reserve)
        # How long to wait before retrying a failed invalidation: the cluster's own comm retry delays.
        self.retry_s = tuple(
            parse_timedelta(dask.config.get(f"distributed.comm.retry.delay.{end}"), default="s")
            for end in ("min", "max")
        )

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.announced: set[str] = set()  # workers running the lifecycle worker plugin
        self.reports: dict[str, dict] = {}  # worker -> last report
        self.history = TaskHistory()  # how long each component's tasks take here
        self.last: dict[tuple[str, str], dict] = {}  # (session, worker) -> last decision sent
        self.counters: Counter[str] = Counter()
        self.ended_bytes: dict[str, dict] = {}  # session -> {worker: invalidate answer}
        self._invalidations: set[asyncio.Future] = set()
        self._ending: dict[str, list] = {}  # worker -> sessions ended since the last batch was sent
        self._calls: dict[str, set[asyncio.Future]] = defaultdict(set)  # worker -> invalidation RPCs on the wire
        # session -> its waiting or processing tasks that use KV, and key -> session: what
        # a prediction reads, kept by the transitions so a pass never scans a whole queue.
        self.kv_tasks: dict[str, set] = defaultdict(set)
        self.kv_task_session: dict = {}
        serve_hello(scheduler)
        scheduler.stream_handlers.update({LIFECYCLE_REPORT: self._on_report, LIFECYCLE_DONE: self._on_done})
        tracker = scheduler.plugins.get(SESSIONS_EXTENSION)
        if tracker is None:
            raise RuntimeError("the kvstate-lifecycle extension needs the kvstate-sessions extension registered first")
        self.tracker = tracker
        tracker.on_end.append(self._on_end)
        for key, ts in list(scheduler.tasks.items()):  # what arrived before this extension
            if ts.state in ("waiting", "processing"):
                self._index(key)
        tracker.loop.add("lifecycle", self.run_once)

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        super().remove_worker(scheduler, worker, **kwargs)
        self.reports.pop(worker, None)

    async def kvstate_goodbye(self, worker: str | None, plugin: str | None) -> bool:
        """The worker's lifecycle half is going: send it nothing more, and answer once what
        is on its way there has been answered (its handler goes when this returns)."""
        await super().kvstate_goodbye(worker, plugin)
        if worker is None or plugin != self.worker_half:
            return True
        self.reports.pop(worker, None)
        for sid, w in [k for k in self.last if k[1] == worker]:
            del self.last[(sid, w)]
        calls = self._calls.get(worker)
        if calls:
            await asyncio.wait(list(calls))
        return True

    async def close(self) -> None:
        for task in list(self._invalidations):
            task.cancel()

    # -- reports -------------------------------------------------------------------------
    def _on_report(self, worker=None, **report) -> None:
        report.pop("op", None)
        self.reports[worker] = report

    def _on_done(self, worker=None, action=None, session=None, decision=None, **outcome) -> None:
        outcome.pop("op", None)
        self.counters[f"{action}_done"] += 1
        self.scheduler.log_event(
            LIFECYCLE_TOPIC,
            {"kind": action, "phase": "done", "session": session, "worker": worker, "decision": decision, **outcome},
        )

    # -- the KV tasks each session waits on or runs -------------------------------------
    def _index(self, key) -> None:
        ts = self.scheduler.tasks.get(key)
        s = self.tracker.session_of(key)
        if ts is not None and s is not None and key not in self.kv_task_session and uses_kv(ts):
            self.kv_tasks[s.id].add(key)
            self.kv_task_session[key] = s.id

    def _unindex(self, key) -> None:
        sid = self.kv_task_session.pop(key)
        keys = self.kv_tasks.get(sid)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.kv_tasks[sid]

    def _track(self, key, finish) -> None:
        """Keep :attr:`kv_tasks` equal to the session's tasks that :meth:`predict` reads.

        A waiting task comes to use KV when one of its inputs arrives as a state, so
        the waiting dependents of a state that reaches memory are looked at again.
        """
        if finish in ("waiting", "processing"):
            self._index(key)
        elif key in self.kv_task_session:
            self._unindex(key)
        if finish == "memory":
            ts = self.scheduler.tasks.get(key)
            if ts is not None and "KVStateRef" in (ts.type or ""):
                for dts in ts.dependents:
                    if dts.state == "waiting":
                        self._index(dts.key)

    # -- durations, from this scheduler's own task history ------------------------------
    def transition(self, key, start, finish, *args, **kwargs) -> None:
        self._track(key, finish)
        ts = self.scheduler.tasks.get(key)
        self.history.transition(key, start, finish, ts)
        if finish == "processing":
            s = self.tracker.session_of(key)
            if s is not None and ts is not None and uses_kv(ts):  # its KV is wanted again
                self._outcomes(s.id)

    # -- the control pass ----------------------------------------------------------------
    def predict(self, session, walk: Walk | None = None) -> tuple[float | None, bool, float]:
        """(predicted seconds until runnable, whether its KV is in use now, the prediction's
        spread: the standard deviation of the awaited durations).

        The session's KV-using waiting tasks each wait on their unfinished dependencies;
        the soonest of them decides (it is the one that will read the KV first). Only
        those tasks are read (:attr:`kv_tasks`), not every task the session holds.
        ``walk`` is the control pass's record of the tasks walked so far
        (:class:`~.lifecycle_history.Walk`), shared by the sessions of one pass.
        """
        now = time()
        best, spread = None, 0.0
        walk = Walk() if walk is None else walk
        for key in list(self.kv_tasks.get(session.id, ())):
            ts = self.scheduler.tasks.get(key)
            if ts is None:
                continue
            if ts.state == "processing" and uses_kv(ts):
                return 0.0, True, 0.0
            if ts.state != "waiting" or not uses_kv(ts):
                continue
            awaited = [d for d in ts.dependencies if d.state != "memory"]
            waits = [self.history.until_done(d, now, walk) for d in awaited]
            p = predict_idle([w[:2] for w in waits])
            if p is not None and (best is None or p < best):
                best, spread = p, max(w[2] for w in waits) ** 0.5
        return best, False, spread

    def costs(self, worker: str, nbytes: int) -> dict:
        rates = self.reports.get(worker, {}).get("rates", {})
        return {
            t: (
                move_seconds(nbytes, rates.get(f"offload:{t}"), self.latency_s),
                move_seconds(nbytes, rates.get(f"restore:{t}"), self.latency_s),
            )
            for t in ("host", "disk")
        }

    def run_once(self) -> None:
        sessions = self.tracker.sessions
        walk = Walk()  # the tasks this pass walked to predict sessions' waits
        for worker, report in list(self.reports.items()):
            if worker not in self.announced or worker not in self.scheduler.stream_comms:
                continue
            dev, host = report["device"], report["host"]
            idle = []
            for sid, per in report["sessions"].items():
                s = sessions.get(sid)
                if s is None:
                    continue
                lower = per["host"] + per["disk"]
                predicted, running, spread = self.predict(s, walk)
                if running:
                    if lower and self.last.get((sid, worker), {}).get("action") != "prefetch":
                        # Ran before any prediction said so (no history, or early): fetch the
                        # rest now rather than block by block from its task.
                        self._send(worker, sid, "prefetch", None, 0.0, self.costs(worker, lower), per, why="running")
                    continue
                # The next pass comes one control interval later: a prefetch left to it may be late.
                due, margin = False, self.margin_s + spread + self.tracker.interval_s
                if predicted is not None:  # no prediction, no rule (lifecycle_action's own answer)
                    costs = self.costs(worker, per["device"] or lower)
                    host_room = host["bytes"] + per["device"] <= host["capacity"]
                    action, tier = lifecycle_action(predicted, per["device"], lower, costs, margin, host_room)
                    if action is not None:
                        self._send(worker, sid, action, tier, predicted, costs, per, why="prediction", margin=margin)
                    # Pressure never takes a session that is due back (it was just fetched, or is
                    # predicted within restore + margin): that would only move it twice.
                    due = predicted <= min(c[1] for c in costs.values()) + margin
                fetched = self.last.get((sid, worker), {}).get("action") == "prefetch"
                if per["device"] and not due and not fetched:
                    idle.append((s.last_activity, sid, per["device"]))
            # Device pressure: the longest-idle suspended sessions leave first.
            need = dev["bytes"] - dev["capacity"] * (1 - self.reserve)
            sizes = {sid: nbytes for _, sid, nbytes in idle}
            for sid in pressure_victims(idle, need):
                if self.last.get((sid, worker), {}).get("action") == "offload":
                    continue  # already on its way out
                tier = "host" if host["bytes"] + sizes[sid] <= host["capacity"] else "disk"
                self._send(
                    worker,
                    sid,
                    "offload",
                    tier,
                    None,
                    self.costs(worker, sizes[sid]),
                    report["sessions"][sid],
                    why="pressure",
                )

    def _send(self, worker, sid, action, tier, predicted, costs, per, why, margin=None) -> None:
        last = self.last.get((sid, worker))
        if last is not None and last["action"] == action and last.get("tier") == tier:
            return  # already asked; the next report shows whether it happened
        decision = {
            "kind": action,
            "phase": "decision",
            "session": sid,
            "worker": worker,
            "tier": tier,
            "predicted_s": predicted,
            "costs": costs,
            "bytes": per,
            "why": why,
            "at": time(),
        }
        if margin is not None:
            decision["margin_s"] = margin  # the prefetch margin plus the prediction's spread
        self.last[(sid, worker)] = {"action": action, "tier": tier, "at": decision["at"], "predicted_s": predicted}
        self.counters[action] += 1
        self.counters[f"{action}_{why}"] += 1
        op = OFFLOAD if action == "offload" else PREFETCH
        msg = {"op": op, "session": sid, "tier": tier, "decision": decision["at"]}
        if action == "prefetch":
            # How long the worker evicts the fetched blocks last: until the task predicted to
            # read them, with room for it to be as late again (later, it was mispredicted,
            # and they compete like any other blocks).
            due = (predicted or 0.0) + (margin if margin is not None else self.margin_s + self.tracker.interval_s)
            msg["expect_s"] = 2 * due
        self.scheduler.stream_comms[worker].send(msg)
        self.scheduler.log_event(LIFECYCLE_TOPIC, decision)

    def _outcomes(self, sid: str) -> None:
        """The session runs again: log how long it really idled against each prediction."""
        now = time()
        for (s, worker), last in list(self.last.items()):
            if s != sid:
                continue
            del self.last[(s, worker)]
            actual = now - last["at"]
            self.scheduler.log_event(
                LIFECYCLE_TOPIC,
                {
                    "kind": last["action"],
                    "phase": "outcome",
                    "session": sid,
                    "worker": worker,
                    "predicted_s": last["predicted_s"],
                    "actual_s": actual,
                    "decision": last["at"],
                },
            )

    # -- invalidation --------------------------------------------------------------------
    def _on_end(self, session) -> None:
        for s, w in [k for k in self.last if k[0] == session.id]:
            del self.last[(s, w)]
        if not self._ending:  # the first end since the last batch: one batch per worker, sent soon
            task = asyncio.ensure_future(self._send_invalidations())
            self._invalidations.add(task)  # a reference until done: the loop keeps only a weak one
            task.add_done_callback(self._invalidations.discard)
        for worker in self.announced:
            self._ending.setdefault(worker, []).append(session.id)

    async def _send_invalidations(self) -> None:
        """One call per worker for the sessions that ended meanwhile (a sweep ends many at once)."""
        await asyncio.sleep(0)
        batches, self._ending = self._ending, {}
        await asyncio.gather(*(self._invalidate(worker, sids) for worker, sids in batches.items()))

    async def _invalidate(self, worker: str, sids: list[str]) -> None:
        """Ask ``worker`` to drop the KV of ``sids`` until it answers or leaves (the worker's call is idempotent)."""
        delay, most = self.retry_s
        while True:
            call = asyncio.ensure_future(getattr(self.scheduler.rpc(worker), INVALIDATE)(sessions=sids))
            self._calls[worker].add(call)  # a goodbye from this worker waits for it
            try:
                res = await call
            except Exception as e:
                res, why = None, f"{type(e).__name__}: {e}"
            else:
                if res is None:  # Dask's answer to an RPC the worker has no handler for
                    self._unhandled(worker, sids)
                    return
                why = f"answered {res!r}"
            finally:
                self._calls[worker].discard(call)
                if not self._calls[worker]:
                    del self._calls[worker]
            if isinstance(res, dict):
                break
            if worker not in self.announced:  # gone, and its blocks with it
                self.counters["invalidations_lost"] += 1
                return
            self.counters["invalidation_retries"] += 1
            logger.info(
                "kvstate lifecycle: invalidating %s on %s failed (%s); retrying in %.2fs", sids, worker, why, delay
            )
            await asyncio.sleep(delay)
            if worker not in self.announced:
                self.counters["invalidations_lost"] += 1
                return
            delay = min(delay * 2, most)
        for sid, answer in res.items():
            self.counters["invalidations"] += 1
            self.counters["invalidated_bytes"] += answer["freed"]
            self.ended_bytes.setdefault(sid, {})[worker] = answer
            self.scheduler.log_event(
                LIFECYCLE_TOPIC, {"kind": "invalidate", "phase": "done", "session": sid, "worker": worker, **answer}
            )
        while len(self.ended_bytes) > 1000:
            self.ended_bytes.pop(next(iter(self.ended_bytes)))

    def _unhandled(self, worker: str, sids: list[str]) -> None:
        """``worker`` has no lifecycle handler: nothing there holds a session's KV, so nothing is lost."""
        self.counters["invalidations_unhandled"] += 1
        if worker in self.announced:
            self.announced.discard(worker)
            self.reports.pop(worker, None)
            logger.info(
                "kvstate lifecycle: %s has no %s handler (its lifecycle half is gone); asking it nothing more",
                worker,
                INVALIDATE,
            )
        self.scheduler.log_event(
            LIFECYCLE_TOPIC,
            {"kind": "invalidate", "phase": "unhandled", "sessions": list(sids), "worker": worker},
        )

    def stats(self) -> dict:
        return {
            **dict(self.counters),
            "workers": len(self.announced),
            "components": self.history.means(),
            "ended": dict(list(self.ended_bytes.items())[-100:]),
            "reports": {
                w: {"device": r["device"], "host": r["host"], "sessions": r["sessions"], "rates": r["rates"]}
                for w, r in self.reports.items()
            },
        }
