"""The ``kvstate-scheduling`` worker plugin: the worker half of the scheduling extensions.

Two handlers Dask has no API for:

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
  updates the worker's own totals (the same arithmetic as ``Worker.set_resources``).
"""

from __future__ import annotations

import logging

from distributed import WorkerPlugin

from dask_kvstate.plugins.worker.handshake import hello
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
        if SESSIONS_EXTENSION not in await hello(worker, self.name):  # the handlers stay unused
            logger.info("kvstate scheduling: scheduler %s has no sessions extension", worker.scheduler.address)

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
        return dict(state.total_resources)
