"""The ``kvstate-scheduling`` worker plugin: the worker half of the scheduling extensions.

Two handlers Dask has no API for, and one fix of the worker's choice of task:

* ``kvstate-reprioritize`` (stream): new priorities for tasks already sent to this
  worker. A worker keeps its ready tasks in heaps keyed by the priority they arrived
  with (``WorkerState.ready`` / ``.constrained``) and nothing re-sorts them, so a
  priority revised on the scheduler would only count for tasks not yet sent. The
  handler re-keys the task and re-inserts it into its heap (a ``HeapSet`` keeps the key
  it was added with, so a remove and add is the only correct re-sort).
* ``kvstate_set_resources`` (RPC): the capacity controller moves a unit of an agent
  role to this worker. ``Worker.set_resources`` would also call the scheduler's
  ``set_resources``, whose ``add_resources`` zeroes the used resources of tasks already
  processing there; the controller updates the scheduler itself, so this only
  updates the worker's own totals (the same arithmetic as ``Worker.set_resources``) and
  then lets the worker start what the new unit admits.
* Constrained tasks start in priority order *among those whose resources are free*
  (:func:`first_fitting`), where Dask's worker stops at the first that does not fit.
"""

from __future__ import annotations

import logging
from time import time

from distributed import WorkerPlugin
from distributed.worker_state_machine import WorkerState

from dask_kvstate.plugins.worker.handshake import hello
from dask_kvstate.plugins.worker.patches import PATCHES, SCHEDULING, STATE_CLASS
from dask_kvstate.protocol import REPRIORITIZE, SCHEDULING_WORKER_PLUGIN, SESSIONS_EXTENSION, SET_RESOURCES

logger = logging.getLogger("dask_kvstate")

_HEAPED = ("ready", "constrained")


def reprioritize(state, priorities: dict) -> int:
    """Give tasks of a ``WorkerState`` new priorities, re-sorting the ready heaps; returns how many moved.

    Tasks not on this worker any more, or already running, are left alone: their
    priority no longer decides anything.
    """
    moved = 0
    for key, priority in priorities.items():
        ts = state.tasks.get(key)
        if ts is None or ts.state not in ("waiting", *_HEAPED):
            continue
        priority = tuple(priority)
        if ts.state in _HEAPED:
            heap = state.ready if ts.state == "ready" else state.constrained
            heap.discard(ts)
            ts.priority = priority
            heap.add(ts)
            moved += 1
        else:
            ts.priority = priority  # it enters its heap with this one when its inputs arrive
    return moved


def first_fitting(state):
    """The highest-priority constrained task whose resources are free now, taken off its heap, or None.

    Dask's worker starts constrained tasks strictly in priority order and stops at the
    first whose resources are all in use (dask/distributed#6136, open): on a worker
    offering units of several roles, a free tester unit idles while a developer task,
    waiting for a developer unit, heads the queue. Skipping that task is safe for role
    units: the tasks started instead take none of the units it waits for.
    """
    satisfied = state._resource_restrictions_satisfied
    for ts in state.constrained.sorted():
        if satisfied(ts):
            state.constrained.discard(ts)
            return ts
    return None


class _FirstFittingState(WorkerState):
    """Dask's ``WorkerState`` with :func:`first_fitting` behind its choice of the next task.

    ``WorkerState`` has slots and no hook for that choice, so a worker's state object is
    given this class (same slots, nothing added) by the plugin's setup, through the
    worker's patch registry (:mod:`~dask_kvstate.plugins.worker.patches`).
    """

    __slots__ = ()

    def _next_ready_task(self):
        ts = super()._next_ready_task()
        if ts is None and self.constrained:
            ts = first_fitting(self)
        return ts


def _first_fitting_class(cls: type) -> type:
    """The class a worker's state is given: :class:`_FirstFittingState` over Dask's own, or a
    class someone else gave it left alone (its layout may not match)."""
    return _FirstFittingState if cls is WorkerState else cls


class SchedulingWorkerPlugin(WorkerPlugin):
    """Registers the two handlers and tells the scheduler they exist."""

    name = SCHEDULING_WORKER_PLUGIN
    idempotent = True

    def __init__(self):
        self.reprioritized = 0
        self.resource_changes = 0

    async def setup(self, worker) -> None:
        self.worker = worker
        worker.stream_handlers[REPRIORITIZE] = self._reprioritize
        worker.handlers[SET_RESOURCES] = self._set_resources
        PATCHES.install(worker, SCHEDULING, {STATE_CLASS: _first_fitting_class}, owner=self)
        if SESSIONS_EXTENSION not in await hello(worker, self.name):  # the handlers stay unused
            logger.info("kvstate scheduling: scheduler %s has no sessions extension", worker.scheduler.address)

    def teardown(self, worker) -> None:
        PATCHES.remove(worker, SCHEDULING, owner=self)

    def _reprioritize(self, priorities=None, **_) -> None:
        self.reprioritized += reprioritize(self.worker.state, priorities or {})

    async def _set_resources(self, resources: dict) -> dict:
        state = self.worker.state
        for r, quantity in resources.items():
            state.available_resources[r] = (
                state.available_resources.get(r, 0) + quantity - state.total_resources.get(r, 0)
            )
            state.total_resources[r] = quantity
        self.resource_changes += 1
        if state.running:
            # A unit added here should start a waiting task now, not at the worker's next
            # completion. The state machine has no event for a change of resources; the
            # unpause event's handler is exactly "running, look for tasks to start", and on
            # a worker that is running (not paused for memory) that is all it does.
            from distributed.worker_state_machine import UnpauseEvent

            self.worker.handle_stimulus(UnpauseEvent(stimulus_id=f"kvstate-set-resources-{time()}"))
        return dict(state.total_resources)
