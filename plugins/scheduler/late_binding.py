"""Late binding of session tasks: they wait on the scheduler for a free thread, best priority first.

Installed on a scheduler by the ``stealing`` extension (``kvstate.scheduling.stealing``).
Why, measured on the role-free SWE workflow (4 single-thread workers, open-loop
arrivals at ~80% load; ``docs/design.md``, "Late binding"):

* **Which tasks wait on the scheduler.** Dask sends a task to a worker as soon as its
  inputs are ready, where it waits in that worker's queue; only tasks of large groups
  with few dependencies (root-ish) wait in the scheduler's ``queued`` heap, for the
  first thread that frees, in priority order. A workflow's calls are small groups, so
  they queue on workers, and a call of a request further along waits behind a new
  request's call while another worker idles. Here a session's task with no
  restriction and no KV input waits on the scheduler when moving its inputs costs at
  most ``late-binding`` times its expected duration. A held task still runs where its
  inputs are whenever that worker has a free thread (below), so binding late costs the
  move only when the holder is busy, and waiting for a busy holder costs about a
  task's duration: hence the default 1.0.
* **Exact slots for session work.** Dask's ``worker-saturation`` (1.1) lets a
  single-thread worker take a second queued task into its own queue, where it can no
  longer go to a thread that frees elsewhere. A worker whose threads are all busy,
  one of them with a late-bound task, takes no more queued work; other workers keep
  Dask's saturation. (Setting the scheduler's saturation to 1.0 instead made a plain
  ``dask.array`` job of 1,600 small chunks on two single-thread workers 1.45x slower,
  9.6 s against 6.6 s: that is what Dask's 1.1 is for.)
* **Long calls only.** A thread idles one scheduler round trip (2-5 ms here) between
  late-bound tasks, so only tasks expected to take at least
  ``late-binding-min-duration`` (20 ms) bind late: a session of 3,000 one-millisecond
  tasks on two single-thread workers took 9.1 s bound late against 4.6 s stock. Not
  higher: Dask's expected duration of a prefix moves halfway to each new measurement,
  and at 50 ms role-free SWE's calls (medians 50-100 ms) dipped below it often enough
  that 10-15% fewer were bound late.
* **Where a held task goes.** Dask gives a queued task to the least busy worker with a
  free slot, blind to its inputs; here a free worker holding more of its input bytes
  goes first, so a tester runs where its developer's context is, and a retry where the
  lane's context is.
* **The continuation slot.** A request that is Python over futures (``await`` a
  result, then submit the next call) reaches the scheduler with its next call a client
  round trip (2-5 ms here) after its last call finished. By then the freed thread has
  gone to the head of the queue, and the request, the most advanced one, waits a whole
  call's duration for the next thread. So when a session's leaf task (no dependents, a
  client waiting on it) finishes while other tasks wait on the scheduler, its thread
  is kept for that session for up to ``continuation-wait``, and the session's next
  late-bound task takes it. The wait is bounded and taken only under contention; a
  session that submits nothing more gives the thread back when it expires.

Dask has no hooks for any of these, so, as the ``hints`` extension does, the wrapper
replaces entries of *this* scheduler's transition table and two of its methods
(``check_idle_saturated``, ``stimulus_queue_slots_maybe_opened``; instance attributes
over the class's), each registered in :mod:`~dask_kvstate.plugins.scheduler.patches`,
and ``uninstall`` takes its layers off again. ``is_rootish`` is left alone: Dask asks
it only in ``waiting -> processing``, whose wrapper decides late-bound tasks first.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from time import time

from dask_kvstate.patching import Wrap
from dask_kvstate.plugins.scheduler.patches import (
    CHECK_IDLE_SATURATED,
    LATE_BINDING,
    PATCHES,
    QUEUE_SLOTS_OPENED,
    edge,
)
from dask_kvstate.protocol import HINTS_EXTENSION

_LEAF_EXITS = (("processing", "memory"),)
_DISPATCHES = (("waiting", "processing"), ("queued", "processing"))


class LateBinding:
    """The scheduler-side queue for a session's movable tasks, their placement and continuation slot."""

    def __init__(
        self, scheduler, tracker, *, fraction: float, min_duration: float, continuation_wait: float, owns: Callable
    ):
        # The settings are validated by their one caller, the stealing extension.
        self.scheduler, self.tracker = scheduler, tracker
        self.fraction, self.min_duration = fraction, min_duration
        self.continuation_wait, self.owns = continuation_wait, owns
        self.counters: Counter[str] = Counter()
        self.kept: dict = {}  # WorkerState -> (Session, token): a thread kept for the session's next call
        self.kept_for: dict = {}  # Session -> [WorkerState], oldest first
        self._installed = False

    # -- install / uninstall -------------------------------------------------------------
    def install(self) -> None:
        if self.fraction <= 0:
            return
        replacements: dict[str, Wrap] = {
            CHECK_IDLE_SATURATED: self._wrap_idle_saturated,
            QUEUE_SLOTS_OPENED: lambda stock: self._queue_slots_maybe_opened,
            **{edge(*e): functools.partial(self._dispatch, queued=e[0] == "queued") for e in _DISPATCHES},
            **{edge(*e): self._leaf_exit for e in _LEAF_EXITS},
        }
        PATCHES.install(self.scheduler, LATE_BINDING, replacements, owner=self)
        self._installed = True

    def uninstall(self) -> None:
        s = self.scheduler
        if not self._installed:  # installed nothing (off)
            return
        PATCHES.remove(s, LATE_BINDING, owner=self)  # leaves another extension's layers in place
        self._installed = False
        kept = list(self.kept)
        self.kept.clear()
        self.kept_for.clear()
        for ws in kept:
            if s.workers.get(ws.address) is ws:
                s.check_idle_saturated(ws)
        if s.status.name == "running":
            s.stimulus_queue_slots_maybe_opened(stimulus_id=f"kvstate-late-binding-close-{time()}")

    def _wrap_idle_saturated(self, stock_idle):
        s = self.scheduler

        def check_idle_saturated(ws, occ: float = -1.0):
            stock_idle(ws, occ)
            if ws in s.idle_task_count and (ws in self.kept or self._busy_with_session_work(ws)):
                s.idle_task_count.discard(ws)  # a kept thread, or every thread on session work

        return check_idle_saturated

    def _queue_slots_maybe_opened(self, *, stimulus_id: str) -> None:
        # Replaces Dask's own, which counts the slots at its saturation up front and asserts
        # that each pop reaches processing; a session task at the head may instead wait
        # for a thread (above), which ends the round.
        s = self.scheduler
        while s.queued and s.idle_task_count:
            head = s.queued.peek()
            s.transitions({head.key: "processing"}, stimulus_id)
            if head.state == "queued":
                return

    # -- which tasks ---------------------------------------------------------------------
    def binds_late(self, ts) -> bool:
        """A session task to hold on the scheduler: unrestricted, no KV input, long enough, inputs cheap to move."""
        if ts.resource_restrictions or ts.worker_restrictions or ts.host_restrictions or ts.actor:
            return False
        if self.tracker.session_of(ts.key) is None or self.owns(ts):
            return False
        s = self.scheduler
        hints = s.plugins.get(HINTS_EXTENSION)
        if hints is not None and getattr(hints, "hinted", None) and hints.hinted_component(ts) is not None:
            return False  # a limited or batched component: the hints extension dispatches it
        duration = s._get_prefix_duration(ts.prefix)  # Dask's unknown-task-duration until measured
        if duration < self.min_duration:
            return False
        transfer = ts.get_nbytes_deps() / s.bandwidth if ts.dependencies else 0.0
        return transfer <= self.fraction * duration

    def _busy_with_session_work(self, ws) -> bool:
        """Every thread of ``ws`` busy, one with a late-bound task (only asked of workers
        with a slot left at Dask's saturation, so ``processing`` is a few tasks)."""
        if len(ws.processing) - len(ws.long_running) < ws.nthreads:
            return False
        return any(self.binds_late(ts) for ts in ws.processing)

    # -- where -----------------------------------------------------------------------------
    def _dispatch(self, orig, queued: bool):
        """``orig`` (into processing), placing late-bound tasks on a kept or input-holding thread."""

        def to_processing(sched, key, stimulus_id, **kwargs):
            ts = sched.tasks[key]
            if not self.binds_late(ts):
                return orig(sched, key, stimulus_id, **kwargs)
            ws = self._kept_worker(ts) or self._free_worker(ts)
            if ws is None:
                return ({}, {}, {}) if queued else ({key: "queued"}, {}, {})
            if queued:
                sched.queued.discard(ts)
            return sched._add_to_processing(ts, ws, stimulus_id=stimulus_id)

        return to_processing

    def _free_worker(self, ts):
        """A worker with a free slot: a free thread first, then most of ``ts``' input bytes, then the least busy."""
        free = self.scheduler.idle_task_count
        if not free:
            return None
        held: Counter = Counter()
        for dts in ts.dependencies:
            for ws in dts.who_has or ():
                if ws in free:
                    held[ws] += dts.get_nbytes()

        def rank(ws):
            busy = len(ws.processing) - len(ws.long_running)
            return (busy < ws.nthreads, held.get(ws, 0), -busy / ws.nthreads)

        ws = max(free, key=rank)
        if held.get(ws):
            self.counters["placed_by_inputs"] += 1
        return ws

    # -- the continuation slot -------------------------------------------------------------
    def _leaf_exit(self, orig):
        def leave_processing(sched, key, stimulus_id, **kwargs):
            ts = sched.tasks[key]
            ws = ts.processing_on
            out = orig(sched, key, stimulus_id, **kwargs)
            if (
                self.continuation_wait > 0
                and ts.state == "memory"
                and ws is not None
                and sched.queued  # others wait: without a kept slot the thread goes to them
                and not ts.dependents
                and ts.who_wants
                and ws not in self.kept
                and not ws.processing
                and sched.workers.get(ws.address) is ws
            ):
                sess = self.tracker.session_of(key)
                if sess is not None and sess.closed_at is None:
                    self._keep(ws, sess)
            return out

        return leave_processing

    def _keep(self, ws, sess) -> None:
        token = object()
        self.kept[ws] = (sess, token)
        self.kept_for.setdefault(sess, []).append(ws)
        self.scheduler.idle_task_count.discard(ws)
        self.counters["continuation_kept"] += 1
        self.scheduler.loop.call_later(self.continuation_wait, self._expire, ws, token)

    def _release(self, ws) -> None:
        sess, _ = self.kept.pop(ws)
        waiting = self.kept_for[sess]
        waiting.remove(ws)
        if not waiting:
            del self.kept_for[sess]

    def _kept_worker(self, ts):
        """The thread kept for ``ts``' session, if one is (and its worker still runs)."""
        if not self.kept_for:
            return None
        sess = self.tracker.session_of(ts.key)
        while sess in self.kept_for:
            ws = self.kept_for[sess][0]
            self._release(ws)
            busy = len(ws.processing) - len(ws.long_running)  # a plain task may have been sent there meanwhile
            if self.scheduler.workers.get(ws.address) is ws and ws in self.scheduler.running and busy < ws.nthreads:
                self.counters["continuation_taken"] += 1
                return ws
        return None

    def _expire(self, ws, token) -> None:
        entry = self.kept.get(ws)
        if entry is None or entry[1] is not token:
            return  # taken (or kept again since)
        self._release(ws)
        self.counters["continuation_expired"] += 1
        s = self.scheduler
        if s.workers.get(ws.address) is ws:
            s.check_idle_saturated(ws)
            s.stimulus_queue_slots_maybe_opened(stimulus_id=f"kvstate-continuation-expired-{time()}")

    def stats(self) -> dict:
        return {
            "late_binding": self.fraction,
            "late_binding_min_duration": self.min_duration,
            "continuation_wait": self.continuation_wait,
            "continuation_kept_now": len(self.kept),
            **dict(self.counters),
        }
