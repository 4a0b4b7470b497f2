"""Dask's own periodic checks, run less often on a cluster whose workers run engines.

Why: an engine's forward pass runs on a team of OpenMP threads, one per core of the host
(vLLM's CPU engine binds its team to them; the transformers backend runs torch's), and
the team waits at every barrier for its slowest thread. Every process of a Dask cluster
also wakes up on timers: each event loop to measure its own latency
(``distributed.admin.tick.interval``), each worker to sample its task threads' stacks for
the dashboard's Profile page (``distributed.worker.profile.interval``), workers and nannies
to read their memory (``distributed.worker.memory.monitor-interval``), all of them for the
system monitor (``distributed.admin.system-monitor.interval``). On a host whose cores all
run the team, each wake-up takes a core from one of its threads and the rest of the team
waits for it; a ``LocalCluster`` of a few workers wakes hundreds of times a second, and an
engine in one of its workers computes measurably slower than alone (the benchmark pages
have the figures).

What: once kvstate is installed, the scheduler, every nanny and every worker run these
callbacks at the ``kvstate.housekeeping.*`` intervals, never more often than Dask's own
config says. They are Dask's ``server.periodic_callbacks`` (tornado ``PeriodicCallback``),
whose ``callback_time`` takes effect from the next call: nothing of distributed is
replaced. The intervals Dask set are kept per process, so a second plugin on one process
(a preloaded nanny that ``kvs.install`` reaches too) changes nothing more, and
unregistering the worker's or nanny's plugin puts them back (the scheduler's go back when
it closes: distributed tells a scheduler plugin nothing when it is removed).

What slows with them, besides the intervals themselves: the dashboard labels profile
samples with ``distributed.worker.profile.interval``, so its Profile times read that
many times too short; the event-loop interval the dashboard and heartbeats report reads
about the tick's interval; the memory a heartbeat reports is the system monitor's last
sample; the "event loop was unresponsive" log line may report up to one tick more than
the loop was blocked; and a memory monitor sees a worker pass its spill, pause or
terminate fraction up to one of its intervals later. On Python versions other than 3.11
each process also samples its event loop from a thread every profile interval, which is
not a periodic callback: set ``distributed.worker.profile.interval`` in each process's
config to slow it.
"""

from __future__ import annotations

import logging
from typing import Any
from weakref import WeakKeyDictionary

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


#: Each process's callbacks' intervals as Dask set them, kept by the first :func:`slow` there
#: and given back by :func:`restore`.
_DASKS: WeakKeyDictionary[Any, dict[str, float]] = WeakKeyDictionary()


def slow(server: Any, wanted: dict[str, float]) -> None:
    """Run ``server``'s callbacks named in ``wanted`` at most as often as it says (ms), and
    never more often than Dask set them; a callback ``server`` does not have is skipped."""
    dasks = _DASKS.setdefault(server, {})
    for name, ms in wanted.items():
        callback = server.periodic_callbacks.get(name)
        if callback is not None:
            callback.callback_time = max(dasks.setdefault(name, callback.callback_time), ms)


def restore(server: Any) -> None:
    """Give ``server``'s callbacks back the intervals Dask set (those gone since are skipped)."""
    for name, ms in _DASKS.pop(server, {}).items():
        callback = server.periodic_callbacks.get(name)
        if callback is not None:
            callback.callback_time = ms


class _Housekeeping:
    """The intervals, read from the config where the plugin is built (the client's, or the
    preloaded process's)."""

    #: ``client.register_plugin`` keeps a plugin of this name that is already there.
    idempotent = True

    def __init__(self, wanted: dict[str, float] | None = None) -> None:
        self.wanted = intervals() if wanted is None else wanted

    def _slow(self, server: Any) -> None:
        slow(server, self.wanted)
        logger.debug("kvstate: %s's periodic callbacks at %s ms at the most often", type(server).__name__, self.wanted)


class HousekeepingWorkerPlugin(_Housekeeping, WorkerPlugin):
    """A worker's tick, profile, system and memory monitors at ``kvstate.housekeeping.*``."""

    name = HOUSEKEEPING_WORKER

    def setup(self, worker) -> None:
        self._slow(worker)

    def teardown(self, worker) -> None:
        restore(worker)


class HousekeepingNannyPlugin(_Housekeeping, NannyPlugin):
    """A nanny's tick, system and memory monitors (it watches its worker's memory) likewise."""

    name = HOUSEKEEPING_NANNY

    def setup(self, nanny) -> None:
        self._slow(nanny)

    def teardown(self, nanny) -> None:
        restore(nanny)


class HousekeepingSchedulerPlugin(_Housekeeping, SchedulerPlugin):
    """The scheduler's tick and system monitor likewise (in a ``LocalCluster``, the client's process)."""

    name = HOUSEKEEPING_SCHEDULER
    scheduler: Any = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self._slow(scheduler)

    async def close(self) -> None:
        if self.scheduler is not None:
            restore(self.scheduler)


def plugins() -> list[Any]:
    """The three plugins, or none when ``kvstate.housekeeping.enabled`` is false."""
    wanted = intervals()
    if not wanted:
        return []
    return [cls(wanted) for cls in (HousekeepingSchedulerPlugin, HousekeepingNannyPlugin, HousekeepingWorkerPlugin)]


def plugin_for(server: Any) -> Any:
    """The plugin for ``server`` (a Scheduler, Nanny or Worker) in a preload; None when it is off."""
    from distributed import Nanny, Scheduler, Worker

    kinds = {Scheduler: HousekeepingSchedulerPlugin, Nanny: HousekeepingNannyPlugin, Worker: HousekeepingWorkerPlugin}
    wanted = intervals()
    for kind, plugin in kinds.items():
        if isinstance(server, kind) and wanted:
            return plugin(wanted)
    return None
