"""The ``hints`` scheduler extension: ``max-concurrency`` and the dispatch of ``batchable`` components.

**max-concurrency: N** (Nalar's per-component concurrency limit): at most N tasks of the
component are ``processing`` at once, cluster-wide. Why in the scheduler, and why this way:

* A limit held inside the task (a ``distributed.Semaphore``) would park each excess task
  on a worker thread, blocking the agents behind it. Worker-side gating of the ready
  heap would need the workers to agree on a cluster-wide count. The scheduler already
  sees every task of the component, so the count is one set per component there.
* Excess tasks wait in Dask's own ``no-worker`` state (``Scheduler.unrunnable``): the
  state for a task whose inputs are ready but which no worker may take now. It holds no
  thread, passes Dask's state validation, is what the dashboard counts as waiting, and
  is the state Dask itself re-dispatches from (``no-worker -> processing``). Not the
  root-ish ``queued`` heap: Dask pops its head whenever a thread frees, so a held task
  at the head would block every other queued task.
* Dask has no hook to refuse a placement, so the extension wraps five entries of *this*
  scheduler's transition table (an instance attribute over the class table, so other
  schedulers in the process are untouched; registered in
  :mod:`~dask_kvstate.plugins.scheduler.patches`): ``waiting -> processing`` and
  ``no-worker -> processing`` go through the gate for hinted components (one dict lookup
  for the rest), and the three exits from ``processing`` free a slot and recommend the
  next held task in the same transition batch, so a freed slot is taken without waiting
  for a control interval.
* The next task is the held one of highest Dask priority, which the ``priority``
  extension keeps equal to workflow progress; the held heaps are re-keyed each control
  pass, so revised priorities count within one interval. A task arriving while others
  of its component are held joins the heap instead of overtaking them.

Limited components skip Dask's root-ish queuing (they are dispatched like non-root
tasks): the limit already bounds how many are sent out. Held tasks are ready work to
``adaptive_target`` (more workers do not release them sooner), and with
``distributed.scheduler.no-workers-timeout`` set their ``unrunnable`` stamps are renewed
each pass so the timeout never fails a task that is only held.

**batchable**: ready tasks of the component are sent to workers, never held in the
root-ish queue, so they can meet in a worker's ready heap, where the ``kvstate-batching``
worker plugin (``plugins/worker/batching.py``, registered on every worker, present and future,
by this extension) runs them as one call.
"""

from __future__ import annotations

import functools
import operator
from collections import Counter
from time import monotonic, time

from distributed.collections import HeapSet
from distributed.diagnostics.plugin import SchedulerPlugin

from dask_kvstate import config
from dask_kvstate.hints import parse_hints
from dask_kvstate.patching import Wrap
from dask_kvstate.plugins.scheduler.patches import HINTS, PATCHES, edge
from dask_kvstate.protocol import (
    BATCHING_WORKER_PLUGIN,
    COMPONENT_ANNOTATION,
    HINTS_EXTENSION,
    PRIORITY_EXTENSION,
    SESSIONS_EXTENSION,
)

_EXITS = (("processing", "memory"), ("processing", "erred"), ("processing", "released"))


def _new_heap() -> HeapSet:
    return HeapSet(key=operator.attrgetter("priority"))


class ComponentHints(SchedulerPlugin):
    """Scheduler side of the ``max-concurrency`` and ``batchable`` component hints."""

    name = HINTS_EXTENSION
    idempotent = True

    def __init__(self, components: dict | None = None, batch_window: str | float | None = None):
        hints = parse_hints(config.get("scheduling.components") if components is None else components)
        self.limits: dict[str, int] = dict(hints.limits)
        self.batch: dict[str, int | None] = dict(hints.batch)
        self.batch_window = config.get_seconds("scheduling.batch-window", batch_window)

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.hinted = frozenset(self.limits) | frozenset(self.batch)
        self.running: dict[str, set] = {c: set() for c in self.limits}  # admitted keys, processing or about to
        self.admitted: dict = {}  # key -> limited component
        self.held: dict[str, HeapSet] = {c: _new_heap() for c in self.limits}
        self.held_comp: dict = {}  # key -> component, for tasks this extension holds in no-worker
        self.peak: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()
        if self.hinted:
            self._install_gate(scheduler)
        if self.batch:
            from distributed.protocol.pickle import dumps

            from dask_kvstate.plugins.worker.batching import BatchingWorkerPlugin

            plugin = BatchingWorkerPlugin(self.batch, self.batch_window)
            await scheduler.register_worker_plugin(None, dumps(plugin), name=BATCHING_WORKER_PLUGIN, idempotent=False)
        self._own_loop = None
        if self.limits:
            tracker = scheduler.plugins.get(SESSIONS_EXTENSION)
            if tracker is not None:  # the one global control loop, after the priority pass
                tracker.loop.add("hints", self.revise)
            else:  # registered alone: a loop of its own, same period
                from dask_kvstate.plugins.scheduler.control import ControlLoop

                self._own_loop = ControlLoop(config.get_seconds("scheduling.interval"))
                self._own_loop.add("hints", self.revise)
                self._own_loop.start()

    async def close(self) -> None:
        """Take the gate off this scheduler's transitions and let held tasks go."""
        s = self.scheduler
        own_loop = getattr(self, "_own_loop", None)
        if own_loop is not None:
            own_loop.stop()
        if getattr(self, "_gated", False):
            PATCHES.remove(s, HINTS, owner=self)
            self._gated = False
            held = [k for k in self.held_comp if getattr(s.tasks.get(k), "state", None) == "no-worker"]
            self.held_comp.clear()
            if held and s.status.name == "running":
                s.transitions(dict.fromkeys(held, "processing"), stimulus_id=f"kvstate-hints-close-{time()}")

    # -- the gate ---------------------------------------------------------------------
    def _install_gate(self, s) -> None:
        replacements: dict[str, Wrap] = {
            edge(start, "processing"): functools.partial(self._enter, from_waiting=start == "waiting")
            for start in ("waiting", "no-worker")
        }
        if self.limits:
            replacements.update({edge(*e): self._exit for e in _EXITS})
        PATCHES.install(s, HINTS, replacements, owner=self)
        self._gated = True

    def _enter(self, orig, from_waiting: bool):
        """``orig`` (a transition into processing), gated for hinted tasks."""

        def enter_processing(sched, key, stimulus_id, **kwargs):
            ts = sched.tasks[key]
            comp = self.hinted_component(ts)
            if comp is None:
                return orig(sched, key, stimulus_id, **kwargs)
            return self._dispatch(ts, comp, stimulus_id, from_waiting=from_waiting)

        return enter_processing

    def _exit(self, orig):
        def leave_processing(sched, key, stimulus_id, **kwargs):
            recs, cmsgs, wmsgs = orig(sched, key, stimulus_id, **kwargs)
            comp = self.admitted.get(key)
            if comp is not None and sched.tasks[key].state != "processing":  # a stale finish keeps it processing
                self._free(comp, key, recs)
            return recs, cmsgs, wmsgs

        return leave_processing

    def hinted_component(self, ts) -> str | None:
        """The task's component when it has a hint handled here, else None (the fast path)."""
        a = ts.annotations
        comp = (a.get(COMPONENT_ANNOTATION) if a else None) or ts.prefix.name
        return comp if comp in self.hinted and not ts.actor else None

    def _dispatch(self, ts, comp: str, stimulus_id: str, *, from_waiting: bool):
        s, key = self.scheduler, ts.key
        limit = self.limits.get(comp)
        if limit is not None and key not in self.admitted:
            if len(self.running[comp]) >= limit or (from_waiting and self._next_held(comp, pop=False) is not None):
                if key not in self.held_comp:
                    self.held_comp[key] = comp
                    self.held[comp].add(ts)
                    self.counters["holds"] += 1
                return ({key: "no-worker"} if from_waiting else {}), {}, {}
            self._admit(comp, key)
        ws = s.decide_worker_non_rootish(ts)  # never the root-ish queue, see the module doc
        if ws is None:  # no worker may run it at all: Dask's own no-worker, holding no slot
            if limit is not None:
                self.running[comp].discard(key)
                self.admitted.pop(key, None)
            return ({key: "no-worker"} if from_waiting else {}), {}, {}
        if not from_waiting:
            s.unrunnable.pop(ts, None)
            if self.held_comp.pop(key, None) is not None:
                self.held[comp].discard(ts)
        return s._add_to_processing(ts, ws, stimulus_id=stimulus_id)

    def _admit(self, comp: str, key) -> None:
        running = self.running[comp]
        running.add(key)
        self.admitted[key] = comp
        if len(running) > self.peak[comp]:
            self.peak[comp] = len(running)

    def _next_held(self, comp: str, pop: bool):
        """The held task of ``comp`` with the highest priority (dropping ones that left no-worker)."""
        heap = self.held[comp]
        while heap:
            ts = heap.peek()
            if ts.state == "no-worker" and self.scheduler.tasks.get(ts.key) is ts:
                if pop:
                    heap.discard(ts)
                    del self.held_comp[ts.key]
                return ts
            heap.discard(ts)  # released or forgotten while held
            self.held_comp.pop(ts.key, None)
        return None

    def _free(self, comp: str, key, recs: dict) -> None:
        self.running[comp].discard(key)
        del self.admitted[key]
        limit = self.limits[comp]
        while len(self.running[comp]) < limit:
            ts = self._next_held(comp, pop=True)
            if ts is None:
                return
            self._admit(comp, ts.key)  # the slot is taken now, so nothing overtakes it in this batch
            recs[ts.key] = "processing"
            self.counters["releases"] += 1

    # -- each control interval -----------------------------------------------------------
    def revise(self) -> None:
        """Re-key the held heaps (priorities may have been revised), repair slots, renew stamps."""
        s = self.scheduler
        recs: dict = {}
        rekey = PRIORITY_EXTENSION in s.plugins  # without it a task's priority never changes once queued
        for comp in self.limits:
            heap = self.held[comp]
            if heap and rekey:
                fresh = _new_heap()
                for ts in heap:
                    if ts.state == "no-worker" and s.tasks.get(ts.key) is ts:
                        fresh.add(ts)
                    else:
                        self.held_comp.pop(ts.key, None)
                self.held[comp] = fresh
            # A slot whose task never reached processing (it cannot happen through the
            # gate; this keeps a bug from shrinking a limit for good).
            for key in [k for k in self.running[comp] if getattr(s.tasks.get(k), "state", None) != "processing"]:
                self.counters["repaired"] += 1
                self._free(comp, key, recs)
        if s.no_workers_timeout and self.held_comp:
            now = monotonic()
            for ts in [ts for ts in s.unrunnable if ts.key in self.held_comp]:
                del s.unrunnable[ts]  # re-insert at the end: unrunnable is ordered by its stamps
                s.unrunnable[ts] = now
        if recs:
            s.transitions(recs, stimulus_id=f"kvstate-hints-{time()}")

    # -- reads ---------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "limits": dict(self.limits),
            "batchable": dict(self.batch),
            "batch_window": self.batch_window,
            "running": {c: len(r) for c, r in self.running.items()},
            "held": {c: len(h) for c, h in self.held.items()},
            "peak": dict(self.peak),
            **dict(self.counters),
        }
