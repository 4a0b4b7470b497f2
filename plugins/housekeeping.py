"""Dask's own periodic checks, run less often on a cluster whose workers run engines.

Why: an engine's forward pass runs on a team of OpenMP threads, one per core of the host
(vLLM's CPU engine binds its team to them; the transformers backend runs torch's), and
the team waits at every barrier for its slowest thread. Every process of a Dask cluster
also wakes up on a timer: each event loop every 20 ms to measure its own latency
(``distributed.admin.tick.interval``), each worker every 10 ms to sample its task threads'
stacks for the dashboard's profile (``distributed.worker.profile.interval``), each
worker and nanny every 100 ms to read their memory, every 500 ms for the system monitor.
On a host whose cores all run the team, each wake-up takes a core from one of its
threads and the rest of the team waits for it; a ``LocalCluster`` of a few workers wakes
hundreds of times a second, and an engine in one of its workers computes measurably
slower than alone (the benchmark pages have the figures).

What: while kvstate is installed, the scheduler, every nanny and every worker run these
callbacks at the ``kvstate.housekeeping.*`` intervals, never more often than Dask's own
config says; unregistering the worker's or the nanny's plugin puts that process's
intervals back (the scheduler's go back when it closes: distributed tells a scheduler
plugin nothing when it is removed). They are Dask's
``server.periodic_callbacks`` (tornado ``PeriodicCallback``), whose ``callback_time`` takes
effect from the next call: nothing of distributed is replaced. What slows with them: the
dashboard's profile (sampled every 100 ms, not 10), its system plots, the "event loop was
unresponsive" log line (still at 3 s, found within a second), and how soon the memory
monitors see a worker pass its pause or terminate fraction.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import NannyPlugin, SchedulerPlugin, WorkerPlugin

from dask_kvstate import config
from dask_kvstate.protocol import HOUSEKEEPING_NANNY, HOUSEKEEPING_SCHEDULER, HOUSEKEEPING_WORKER

logger = logging.getLogger(__name__)

#: ``kvstate.housekeeping.<key>`` -> the periodic callbacks (``server.periodic_callbacks``
#: names) it times, on whichever servers have them.
CALLBACKS = {
    "tick": ("tick",),
    "profile": ("profile",),
    "system-monitor": ("monitor",),
    "memory-monitor": ("memory_monitor",),
}


def intervals() -> dict[str, float]:
    """``{callback name: milliseconds}`` from ``kvstate.housekeeping.*``; ``{}`` when it is off."""
    enabled = config.get("housekeeping.enabled")
    if not isinstance(enabled, bool):
        raise ValueError(f"kvstate.housekeeping.enabled must be a bool, got {enabled!r}")
    if not enabled:
        return {}
    return {
        name: 1000 * config.get_seconds(f"housekeeping.{key}") for key, names in CALLBACKS.items() for name in names
    }


def slow(server: Any, wanted: dict[str, float]) -> dict[str, float]:
    """Run ``server``'s callbacks named in ``wanted`` at most as often as it says; returns the
    intervals it replaced (ms), for :func:`restore`. A callback already slower keeps its time."""
    replaced = {}
    for name, ms in wanted.items():
        callback = server.periodic_callbacks.get(name)
        if callback is not None and callback.callback_time < ms:
            replaced[name] = callback.callback_time
            callback.callback_time = ms
    return replaced


def restore(server: Any, replaced: dict[str, float]) -> None:
    """Put back the intervals :func:`slow` replaced (callbacks gone since are skipped)."""
    for name, ms in replaced.items():
        callback = server.periodic_callbacks.get(name)
        if callback is not None:
            callback.callback_time = ms


class _Housekeeping:
    """The intervals, read from the config where the plugin is built (the client's, or the
    preloaded process's), and what they replaced on the process that runs the plugin."""

    #: ``client.register_plugin`` keeps a plugin of this name that is already there, with
    #: the intervals it replaced (a second one would find them slowed and keep nothing to restore).
    idempotent = True

    def __init__(self) -> None:
        self.wanted = intervals()
        self.replaced: dict[str, float] = {}

    def _slow(self, server: Any) -> None:
        self.replaced = slow(server, self.wanted)
        if self.replaced:
            logger.debug("kvstate: %s runs %s less often", type(server).__name__, sorted(self.replaced))

    def _restore(self, server: Any) -> None:
        restore(server, self.replaced)
        self.replaced = {}


class HousekeepingWorkerPlugin(_Housekeeping, WorkerPlugin):
    """A worker's tick, profile, system and memory monitors at ``kvstate.housekeeping.*``."""

    name = HOUSEKEEPING_WORKER

    def setup(self, worker) -> None:
        self._slow(worker)

    def teardown(self, worker) -> None:
        self._restore(worker)


class HousekeepingNannyPlugin(_Housekeeping, NannyPlugin):
    """A nanny's tick, system and memory monitors (it watches its worker's memory) likewise."""

    name = HOUSEKEEPING_NANNY

    def setup(self, nanny) -> None:
        self._slow(nanny)

    def teardown(self, nanny) -> None:
        self._restore(nanny)


class HousekeepingSchedulerPlugin(_Housekeeping, SchedulerPlugin):
    """The scheduler's tick and system monitor likewise (in a ``LocalCluster``, the client's process)."""

    name = HOUSEKEEPING_SCHEDULER

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self._slow(scheduler)

    async def close(self) -> None:
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            self._restore(scheduler)


def plugins() -> list[Any]:
    """The three plugins, or none when ``kvstate.housekeeping.enabled`` is false."""
    if not intervals():
        return []
    return [HousekeepingSchedulerPlugin(), HousekeepingNannyPlugin(), HousekeepingWorkerPlugin()]


def plugin_for(server: Any) -> Any:
    """The plugin for ``server`` (a Scheduler, Nanny or Worker) in a preload; None when it is off."""
    from distributed import Nanny, Scheduler, Worker

    kinds = {Scheduler: HousekeepingSchedulerPlugin, Nanny: HousekeepingNannyPlugin, Worker: HousekeepingWorkerPlugin}
    for kind, plugin in kinds.items():
        if isinstance(server, kind):
            return plugin() if intervals() else None
    return None
