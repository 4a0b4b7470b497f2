"""The ``priority`` scheduler extension: workflow-progress priority (Nalar 5.2).

Within a component, ready work of sessions that have completed more invocations runs
first (it favours in-flight workflows, such as a failed test going back to its
developer, over newly arrived requests); equal progress runs in arrival order. With
``kvstate.scheduling.priority.kv-resident`` a task whose KV blocks are already on its
worker also goes ahead of equal-progress work elsewhere in the queue.

Dask priorities are tuples compared lexicographically, lowest first:
``(-user priority, graph generation, dask.order position)``. This extension keeps the
user priority in front and the stock tail behind, inserting the workflow terms::

    (-user priority, -progress, -kv resident, session arrival, generation, order)

so user priorities still win and ``dask.order`` still orders the tasks of one graph.
Tasks outside any session get progress 0 and their submission time as arrival.

Applied at submission (``update_graph``), then revised each control interval for the
sessions whose progress changed: on the scheduler for queued (root-ish, the
scheduler's ``queued`` heap is re-keyed) and ``no-worker`` tasks, and on the workers,
through the ``kvstate-reprioritize`` handler, for tasks already sent to them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from time import time

from distributed.diagnostics.plugin import SchedulerPlugin

from dask_kvstate import config
from dask_kvstate.protocol import (
    PLACEMENT_EXTENSION,
    PRIORITY_EXTENSION,
    PRIORITY_TOPIC,
    REPRIORITIZE,
    SESSIONS_EXTENSION,
)

OURS = 6  # length of the priority tuples this extension writes


def progress_priority(stock: tuple, progress: int, arrival: float, resident: bool = False) -> tuple:
    """The workflow-progress priority of a task whose stock Dask priority is ``stock``.

    Examples
    --------
    >>> new = progress_priority((0, 1, 7), progress=0, arrival=10.0)
    >>> ahead = progress_priority((0, 1, 9), progress=3, arrival=12.0)   # more progress
    >>> older = progress_priority((0, 1, 8), progress=0, arrival=5.0)    # same progress, earlier
    >>> sorted([new, ahead, older]) == [ahead, older, new]
    True
    >>> progress_priority((-5, 1, 7), 0, 1.0) < progress_priority((0, 1, 7), 9, 0.0)   # user priority first
    True
    """
    base = stock[:1] + stock[-2:] if len(stock) == OURS else stock
    return (base[0], -progress, -int(resident), arrival, *base[1:])


class ProgressPriority(SchedulerPlugin):
    """Scheduler side of workflow-progress priority (installed by ``kvs.install`` when enabled)."""

    name = PRIORITY_EXTENSION
    idempotent = True

    def __init__(self, kv_resident: bool | None = None):
        kv = config.get("scheduling.priority.kv-resident") if kv_resident is None else kv_resident
        if not isinstance(kv, bool):
            raise ValueError(f"kvstate.scheduling.priority.kv-resident must be a bool, got {kv!r}")
        self.kv_resident = kv

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.tracker = scheduler.plugins.get(SESSIONS_EXTENSION)
        assert self.tracker is not None, "the priority extension needs the sessions extension registered first"
        self.seen_progress: dict[str, int] = {}
        self.counters: Counter[str] = Counter()
        self.tracker.loop.add("priority", self.revise)

    # -- at submission ---------------------------------------------------------------
    def update_graph(self, scheduler, *, tasks=(), **kwargs) -> None:
        now = time()
        for key in tasks:
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state != "released" or not ts.priority or ts.run_spec is None:
                continue  # only tasks this graph created; running ones keep theirs
            s = self.tracker.session_of(key)
            ts.priority = progress_priority(ts.priority, s.progress if s else 0, s.arrival if s else now)
            self.counters["submitted"] += 1

    # -- each control interval -----------------------------------------------------------
    def revise(self) -> None:
        """Re-key the live tasks of sessions whose progress changed since the last pass."""
        s_ = self.scheduler
        to_workers: dict[str, dict] = defaultdict(dict)
        placement = s_.plugins.get(PLACEMENT_EXTENSION) if self.kv_resident else None
        live = self.tracker.sessions
        for sid in [sid for sid in self.seen_progress if sid not in live]:
            del self.seen_progress[sid]
        for sid, sess in live.items():
            if self.seen_progress.get(sid) == sess.progress and placement is None:
                continue
            self.seen_progress[sid] = sess.progress
            for key in sess.live:
                ts = s_.tasks.get(key)
                if ts is None or not ts.priority or ts.state not in ("queued", "no-worker", "processing", "waiting"):
                    continue
                ws = ts.processing_on
                if ws is not None and ts in ws.executing:
                    continue  # running: nothing left to order
                resident = placement is not None and ws is not None and self._resident(placement, ts, ws.address)
                new = progress_priority(ts.priority, sess.progress, sess.arrival, resident)
                if new == ts.priority:
                    continue
                if ts.state == "queued":
                    s_.queued.discard(ts)  # a HeapSet keeps the key a task was added with
                    ts.priority = new
                    s_.queued.add(ts)
                    self.counters["queued_revised"] += 1
                else:
                    ts.priority = new
                    if ws is not None and ws.address in self.tracker.announced:
                        to_workers[ws.address][key] = new
                    self.counters["scheduler_revised" if ws is None else "worker_revised"] += 1
        for addr, prios in to_workers.items():
            comm = s_.stream_comms.get(addr)
            if comm is not None:
                comm.send({"op": REPRIORITIZE, "priorities": prios})
        if to_workers:
            s_.log_event(
                PRIORITY_TOPIC,
                {"kind": "revise", "workers": len(to_workers), "tasks": sum(map(len, to_workers.values()))},
            )

    @staticmethod
    def _resident(placement, ts, worker: str) -> bool:
        """All KV blocks of the states ``ts`` consumes are already on ``worker``."""
        held = placement.blocks_on.get(worker, ())
        refs = [placement.refs[d.key] for d in ts.dependencies if d.key in placement.refs]
        return bool(refs) and all(h in held for r in refs for h in r["blocks"])

    def stats(self) -> dict:
        return {**dict(self.counters), "kv_resident": self.kv_resident}
