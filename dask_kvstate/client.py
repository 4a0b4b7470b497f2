"""Client-side entry points: attach the plugins to a cluster (:func:`install`), read what they did (:func:`stats`).

Both work the same under a synchronous and an asynchronous client: each is one
coroutine run through ``client.sync``, which blocks a synchronous client's caller and
hands an asynchronous client's caller the awaitable.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

from distributed import Client

from dask_kvstate import extensions as ext
from dask_kvstate.plugins import housekeeping
from dask_kvstate.protocol import (
    CAPACITY_EXTENSION,
    HINTS_EXTENSION,
    LIFECYCLE_EXTENSION,
    PLACEMENT_EXTENSION,
    PRIORITY_EXTENSION,
    SESSIONS_EXTENSION,
    STEALING_EXTENSION,
    WORKER_PLUGIN,
)
from dask_kvstate.views import ClusterStats, Stats

if TYPE_CHECKING:
    from dask_kvstate.plugins.worker.plugin import KVStateWorkerPlugin


def install(
    client: Client,
    model: str | list[str] | Literal[False] | None = None,
    *,
    backend: str | None = None,
    scheduling: bool | Mapping[str, bool] | None = None,
    lifecycle: bool | None = None,
    torch_threads: int | None = None,
    device_bytes: int | str | None = None,
    host_bytes: int | str | None = None,
    disk_bytes: int | str | None = None,
) -> dict:
    """Load ``model`` and a KV block store on every worker, and every enabled extension on the scheduler.

    Parameters
    ----------
    client : distributed.Client
        Synchronous or asynchronous; an asynchronous client gets an awaitable of the result.
    model : str, list of str, None or False
        A known name (``smollm2-135m``, ``tiny-llama``) or a local model folder, or a
        list of them (the first is the default for calls that name none). ``None``:
        ``kvstate.model``. ``False``: no model and no block store, for workflows of plain
        Python functions: only the scheduling extensions (sessions, priority, stealing,
        capacity, hints) and their worker half; placement, the observe extension and the
        lifecycle serve KV state and are skipped.
    backend : str, optional
        What computes on the workers: ``"hf"`` (Hugging Face transformers) or ``"vllm"``
        (a vLLM engine per worker; the ``vllm`` extra). ``None``: ``kvstate.backend``.
    scheduling : bool or mapping, optional
        Overrides ``kvstate.scheduling.<name>.enabled``: ``True`` / ``False`` switches all of
        sessions, priority, stealing, capacity and hints on / off, ``{"stealing": True}``
        only the ones named. ``None``: as the config says.
    lifecycle : bool, optional
        Overrides ``kvstate.lifecycle.enabled``.
    torch_threads, device_bytes, host_bytes, disk_bytes
        The worker plugin's threads and tier budgets (default ``kvstate.worker.*``).

    Registers, from the config's ``enabled`` keys (see :mod:`dask_kvstate.extensions`,
    the same list the preload adds): the placement and observe extensions, the session
    tracker and the scheduling policies, the lifecycle, then the ``kvstate`` worker plugin
    and the extensions' worker halves. After them, with a model and unless
    ``kvstate.housekeeping.enabled`` is false, a plugin on the scheduler, every nanny and
    every worker that runs Dask's own periodic checks less often
    (:mod:`dask_kvstate.plugins.housekeeping`: they preempt the engine's threads).
    Idempotent: a second call with the same settings reloads nothing, and workers that
    join later get every plugin too. Extensions already running stay, whatever the
    overrides say. Raises ValueError for an unknown model name (listing the known ones)
    or a bad setting or override, before touching the cluster.

    Returns ``{worker address: the kvstate plugin's settings}`` (``{}`` with ``model=False``).
    """
    options: dict = {
        "backend": backend,
        "torch_threads": torch_threads,
        "device_bytes": device_bytes,
        "host_bytes": host_bytes,
        "disk_bytes": disk_bytes,
    }
    on = ext.enabled(scheduling, lifecycle)
    store = None
    if model is False:  # no block store: only what serves plain tasks
        given = sorted(k for k, v in options.items() if v is not None) + (["lifecycle"] if lifecycle else [])
        if given:
            raise ValueError(f"model=False installs no block store, so {given} cannot apply; give a model")
        on.update(dict.fromkeys(ext.NEED_STORE, False))
    elif model is True:
        raise ValueError("model must be a model name, a list of them, None (kvstate.model) or False (no model)")
    else:
        from dask_kvstate.plugins.worker.plugin import KVStateWorkerPlugin

        store = KVStateWorkerPlugin(model, **options)
    plugins = ext.extensions(on)
    quieter = housekeeping.plugins() if store is not None else []  # plain Python tasks compute on no engine
    return client.sync(_install, client, plugins, store, quieter)


async def _install(
    client: Client, plugins: ext.Extensions, store: KVStateWorkerPlugin | None, quieter: list | None = None
) -> dict:
    for extension in plugins.scheduler:
        await client.register_plugin(extension)  # idempotent: a no-op when one of that name is there
    current: dict = {}
    if store is not None:
        current = await client.run(_plugin_settings)
        if not current or any(s != store.settings() for s in current.values()):
            try:
                await client.register_plugin(store, name=WORKER_PLUGIN)
            except BaseException:
                # A setup that failed (a model a worker cannot load) leaves no half-installed
                # plugin behind: workers joining later would fail the same way.
                await client.unregister_worker_plugin(WORKER_PLUGIN)
                raise
            current = await client.run(_plugin_settings)
    for half in plugins.worker:  # after the kvstate plugin: the lifecycle half times moves on its store
        await client.register_plugin(half)
    for plugin in quieter or ():  # last: a model that fails to load leaves Dask's timers as they were
        await client.register_plugin(plugin)
    return current


def _plugin_settings(dask_worker) -> dict | None:
    plugin = dask_worker.plugins.get(WORKER_PLUGIN)
    return None if plugin is None or plugin.runtime is None else plugin.settings()


def stats(client: Client) -> Stats:
    """What kvstate did on the cluster, as one :class:`~dask_kvstate.views.Stats` object.

    Sections:

    * ``workers``: ``{worker: {blocks, bytes, hits, transfers, ...}}``, a dict
      (:class:`~dask_kvstate.views.ClusterStats`) with ``.totals``. Keys: ``model``,
      ``blocks`` and ``bytes`` (all tiers), ``pinned_bytes`` (held by refs),
      ``hits``/``misses``, ``evictions``, ``dropped``, ``tiers`` (per tier: blocks, bytes,
      capacity, hits, misses, spills, unspills; device ``peak_bytes``; disk
      ``checksum_failures`` and ``full``), and the runtime's counters
      (``prefill_tokens`` (prompt tokens the model computed: not those a vLLM engine's own
      prefix cache served), ``reused_tokens`` (from states), ``transfers`` (blocks pulled),
      ``transfer_bytes``, ``transfer_seconds``, ``recomputes`` (blocks rebuilt),
      ``recompute_tokens``, ``incompatible``, ``materializations``, ``resumes``, ``forks``,
      ``evicted_bytes``, ``served_zero_copy`` / ``served_packed`` (pulls this worker served
      as one run of a block arena's memory / packed into a reply buffer),
      ``pulls_zero_copy`` / ``pulls_packed`` (the same, seen by the puller),
      ``transfer_failures`` (pulls that failed, recomputed), ``pull_checksum_failures`` (of
      those, replies whose frames failed ``kvstate.transport.checksum``), ``rejected_blocks``
      (pulled blocks not asked for or of the wrong shape, dropped), ...), and
      ``arena_overhang_bytes`` (memory arenas keep alive beyond the blocks the tiers
      count). Counters never seen are absent; read them with ``.get``.
    * ``placement``: decisions, choices, outcomes, slower choices, errors.
    * ``scheduling``: ``{"sessions": {open, ended, sessions, recently_ended,
      control_loop, ...}, "priority": {...}, "stealing": {moves, kept, affinity_kept,
      queued_seen, ...}, "capacity": {moves, last, latency, ...}, "hints": {limits,
      running, held, peak, ...}}``; ``sessions.control_loop`` holds, per policy and in
      total, the pass latency (count, mean, p50, p99, max in ms).
    * ``lifecycle``: offloads, prefetches, invalidations (bytes freed, left, shared per
      ended session and worker), component mean durations, and each worker's last report
      (session bytes per tier, measured move rates).

    An extension that is off reads ``{"installed": False}``, as does a worker without the
    plugin; never raises for either. The scheduler's sections come from one call to it.
    Prints as text tables, renders as HTML in Jupyter; an asynchronous client gets an
    awaitable of it.
    """
    return client.sync(_stats, client)


async def _stats(client: Client) -> Stats:
    workers, sections = await asyncio.gather(client.run(_worker_stats), client.run_on_scheduler(_scheduler_stats))
    return Stats(workers=ClusterStats(workers), **sections)


def _worker_stats(dask_worker) -> dict:
    # Runs on the worker (client.run): the same entry its reporter pushes to the dashboard.
    from dask_kvstate.plugins.worker.reporter import worker_stats

    return worker_stats(dask_worker.plugins.get(WORKER_PLUGIN))


def _section(dask_scheduler, name: str) -> dict:
    plugin = dask_scheduler.plugins.get(name)
    return {"installed": False} if plugin is None else {"installed": True, **plugin.stats()}


#: The ``scheduling`` section of :class:`Stats`: its parts and the extensions they come from.
_SCHEDULING_SECTIONS = {
    "sessions": SESSIONS_EXTENSION,
    "priority": PRIORITY_EXTENSION,
    "stealing": STEALING_EXTENSION,
    "capacity": CAPACITY_EXTENSION,
    "hints": HINTS_EXTENSION,
}


def _scheduler_stats(dask_scheduler) -> dict:
    return {
        "placement": _section(dask_scheduler, PLACEMENT_EXTENSION),
        "scheduling": {part: _section(dask_scheduler, name) for part, name in _SCHEDULING_SECTIONS.items()},
        "lifecycle": _section(dask_scheduler, LIFECYCLE_EXTENSION),
    }


# -- deprecated aliases, kept one release: each warns, naming its replacement -------------------
def _deprecated(name: str, replacement: str) -> None:
    warnings.warn(f"kvs.{name} is deprecated; use {replacement}", FutureWarning, stacklevel=3)


def install_scheduling(client: Client) -> list[str]:
    """Deprecated: ``kvs.install(client, model=False)``. Returns the scheduling extensions' names
    (an awaitable of them with an asynchronous client)."""
    _deprecated("install_scheduling(client)", "kvs.install(client, model=False)")
    plugins = ext.extensions({name: v for name, v in ext.enabled().items() if name in ext.SCHEDULING})
    if not plugins.scheduler:
        return []
    return client.sync(_register, client, plugins, plugins.names)


def install_lifecycle(client: Client) -> list[str]:
    """Deprecated: ``kvs.install(client, lifecycle=True)``. Registers the session tracker, the
    lifecycle extension and its worker half; returns their names."""
    _deprecated("install_lifecycle(client)", "kvs.install(client, lifecycle=True)")
    plugins = ext.extensions({"lifecycle": True})
    return client.sync(_register, client, plugins, plugins.names + [p.name for p in plugins.worker])  # type: ignore[attr-defined]


async def _register(client: Client, plugins: ext.Extensions, names: list[str]) -> list[str]:
    await _install(client, plugins, None)
    return names


def placement_stats(client: Client) -> dict:
    """Deprecated: ``kvs.stats(client).placement``."""
    _deprecated("placement_stats(client)", "kvs.stats(client).placement")
    return client.run_on_scheduler(_scheduler_section, "placement")


def scheduling_stats(client: Client) -> dict:
    """Deprecated: ``kvs.stats(client).scheduling``."""
    _deprecated("scheduling_stats(client)", "kvs.stats(client).scheduling")
    return client.run_on_scheduler(_scheduler_section, "scheduling")


def lifecycle_stats(client: Client) -> dict:
    """Deprecated: ``kvs.stats(client).lifecycle``."""
    _deprecated("lifecycle_stats(client)", "kvs.stats(client).lifecycle")
    return client.run_on_scheduler(_scheduler_section, "lifecycle")


def _scheduler_section(name: str, dask_scheduler=None) -> dict:
    return _scheduler_stats(dask_scheduler)[name]
