"""What the runtime asks and tells the scheduler, and what it reads of the running task.

Every exchange with the scheduler that the operators make sits here, so the runtime's
other modules are plain computation: the placement extension's assignment of the
running task (its annotation: the worker chosen, the state's copies, the idle threads
there), the idle threads a long prefill may borrow and the other workers holding a
state's blocks (RPCs to the extension, only for a task it did not place), and the
outcome of a transfer-or-recompute choice (a stream message, only to a scheduler that
runs the extension). Every function here is a no-op
or a neutral answer without a worker (the runtime used directly, as benchmarks do).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from dask_kvstate.placement import Assignment
from dask_kvstate.protocol import HOLDERS, IDLE_THREADS, OUTCOME, PLACEMENT_ANNOTATION, WORKER_PLUGIN

logger = logging.getLogger("dask_kvstate")


def current_task(worker) -> Hashable | None:
    """The key of the task running in this thread, or None (no worker, or not inside a task)."""
    if worker is None:
        return None
    try:
        return worker.get_current_task()
    except KeyError:  # not inside a task (direct use from tools)
        return None


def idle_threads(worker, timeout: float) -> int:
    """Threads idle on this worker's host that the running task's long prefill may borrow; 0
    if nobody can say.

    A task the placement extension sent here carries the count it saw then (its
    :class:`~dask_kvstate.placement.Assignment`); any other costs one scheduler round trip.
    Never raises: without the extension, or with the scheduler away, the answer is 0
    (borrow nothing).
    """
    from distributed.utils import sync

    placed = assignment(worker, current_task(worker))
    if placed is not None and placed.worker == getattr(worker, "address", None):
        return placed.idle_threads
    try:
        return int(
            sync(
                worker.loop,
                getattr(worker.scheduler, IDLE_THREADS),
                worker=worker.address,
                callback_timeout=timeout,
            )
        )
    except Exception as e:  # no placement extension, a scheduler away: just don't borrow
        logger.debug("kvstate: not borrowing threads (%s)", e)
        return 0


def holders(worker, blocks: list[bytes], timeout: float) -> list[str]:
    """Running workers other than this one that the placement extension knows to hold every
    one of ``blocks``; ``[]`` if it cannot say.

    Costs one scheduler round trip: only for a task the extension did not place (its
    assignment names the copies). Never raises: without the extension, or with the
    scheduler away, there are no other holders to choose from.
    """
    from distributed.utils import sync

    try:
        found = sync(
            worker.loop,
            getattr(worker.scheduler, HOLDERS),
            blocks=list(blocks),
            worker=worker.address,
            callback_timeout=timeout,
        )
    except Exception as e:  # no placement extension, a scheduler away: the named holder only
        logger.debug("kvstate: no other holders asked (%s)", e)
        return []
    return [w for w in found if isinstance(w, str)] if isinstance(found, (list, tuple)) else []


def assignment(worker, key: Hashable | None) -> Assignment | None:
    """The placement extension's word on task ``key`` (its ``kvstate-placement``
    annotation), or None when the task carries none, or one this worker cannot read
    (then it decides by itself, as for a task the extension never saw)."""
    ts = worker.state.tasks.get(key) if worker is not None and key is not None else None
    raw = (ts.annotations or {}).get(PLACEMENT_ANNOTATION) if ts is not None else None
    if raw is None:
        return None
    try:
        return Assignment.from_wire(raw)
    except (TypeError, ValueError):
        return None


def send_outcome(worker, decision: dict) -> None:
    """Tell the placement extension how a choice it priced turned out (if it runs)."""
    plugin = worker.plugins.get(WORKER_PLUGIN) if worker is not None else None
    if plugin is not None and plugin.placement:
        worker.loop.add_callback(worker.batched_stream.send, {"op": OUTCOME, **decision})
