"""Client-side entry points: attach the plugins to a cluster, read their counters."""

from __future__ import annotations

from distributed import Client

from dask_kvstate import config
from dask_kvstate.plugins.worker.plugin import KVStateWorkerPlugin
from dask_kvstate.protocol import PLACEMENT_EXTENSION, SCHEDULING_EXTENSIONS, WORKER_PLUGIN
from dask_kvstate.views import ClusterStats


def _plugin_settings(dask_worker) -> dict | None:
    plugin = dask_worker.plugins.get(WORKER_PLUGIN)
    return None if plugin is None or plugin.runtime is None else plugin.settings()


def install(
    client: Client,
    model: str | list[str] | None = None,
    *,
    torch_threads: int | None = None,
    device_bytes: int | str | None = None,
    host_bytes: int | str | None = None,
    disk_bytes: int | str | None = None,
) -> dict:
    """Load ``model`` (or several: a list) and a KV block store on every worker.

    Idempotent: when every worker already runs the plugin with the same settings,
    nothing is reloaded. Workers that join later get it too. Raises ValueError for an
    unknown model name (listing the known ones) before touching the cluster.

    Returns ``{worker address: settings}``.
    """
    plugin = KVStateWorkerPlugin(
        model, torch_threads=torch_threads, device_bytes=device_bytes, host_bytes=host_bytes, disk_bytes=disk_bytes
    )
    if config.get("placement.enabled"):
        from dask_kvstate.plugins.scheduler.placement import KVPlacement

        client.register_plugin(KVPlacement())  # idempotent: a no-op when already there
    from dask_kvstate.plugins.scheduler.observe import KVObserver

    client.register_plugin(KVObserver())  # stats, history and the /kvstate page; idempotent too
    install_scheduling(client)
    current = client.run(_plugin_settings)
    if not current or any(s != plugin.settings() for s in current.values()):
        client.register_plugin(plugin, name=WORKER_PLUGIN)
        current = client.run(_plugin_settings)
    if config.get("lifecycle.enabled"):  # after the kvstate plugin: it times moves on its store
        from dask_kvstate.lifecycle import install_lifecycle

        install_lifecycle(client)
    return current


def _worker_stats(dask_worker) -> dict:
    plugin = dask_worker.plugins.get(WORKER_PLUGIN)
    if plugin is None or plugin.runtime is None:
        return {"installed": False}
    return {"installed": True, **plugin.runtime.stats(), "models": list(plugin.models)}


def _placement_stats(dask_scheduler) -> dict:
    plugin = dask_scheduler.plugins.get(PLACEMENT_EXTENSION)
    return {"installed": False} if plugin is None else {"installed": True, **plugin.stats()}


def placement_stats(client: Client) -> dict:
    """The scheduler's placement extension: decisions, choices, outcomes, slower choices."""
    return client.run_on_scheduler(_placement_stats)


def stats(client: Client) -> ClusterStats:
    """Per-worker counters and bytes: ``{worker: {blocks, bytes, hits, transfers, ...}}``.

    Keys: ``model``, ``blocks`` and ``bytes`` (all tiers), ``pinned_bytes`` (held by
    refs), ``hits``/``misses``, ``evictions``, ``dropped``, ``tiers`` (per tier: blocks,
    bytes, capacity, hits, misses, spills, unspills; device ``peak_bytes``; disk
    ``checksum_failures`` and ``full``), and the runtime's
    counters (``prefill_tokens``, ``reused_tokens``, ``transfers`` (blocks pulled),
    ``transfer_bytes``, ``transfer_seconds``, ``recomputes`` (blocks rebuilt),
    ``recompute_tokens``, ``incompatible``, ``materializations``, ``resumes``, ``forks``,
    ``evicted_bytes``, ``served_zero_copy`` / ``served_packed`` (pulls this worker
    served as one run of a block arena's memory / packed into a reply buffer),
    ``pulls_zero_copy`` / ``pulls_packed`` (the same, seen by the puller), ...), and
    ``arena_overhang_bytes`` (memory arenas keep alive beyond the blocks the tiers
    count). Counters never seen are absent; read them with ``.get``.

    The result is a dict (:class:`~dask_kvstate.views.ClusterStats`) that prints as a
    table with totals and renders as HTML in Jupyter.
    """
    result = client.run(_worker_stats)
    if client.asynchronous:  # an awaitable, as client.run returns there
        return _as_cluster_stats(result)
    return ClusterStats(result)


async def _as_cluster_stats(pending) -> ClusterStats:
    return ClusterStats(await pending)


# -- workflow-aware scheduling (Nalar): sessions, priority, stealing, capacity --------------
def scheduling_plugins() -> list:
    """The scheduling extensions ``kvstate.scheduling.*`` switches on, sessions first (the
    others read it), then the ``kvstate-scheduling`` worker plugin; empty when all are off.
    Shared by :func:`install_scheduling` and the preload (``dask_kvstate.plugins``)."""
    from dask_kvstate.plugins.scheduler.capacity import CapacityController
    from dask_kvstate.plugins.scheduler.priority import ProgressPriority
    from dask_kvstate.plugins.scheduler.sessions import SessionTracker
    from dask_kvstate.plugins.scheduler.stealing import LateBindingStealing
    from dask_kvstate.plugins.worker.scheduling import SchedulingWorkerPlugin

    wanted = [
        cls()
        for key, cls in (
            ("priority.enabled", ProgressPriority),
            ("stealing.enabled", LateBindingStealing),
            ("capacity.enabled", CapacityController),
        )
        if config.get(f"scheduling.{key}")
    ]
    # Component hints (max-concurrency, batchable): their extension, whenever a hint asks for it.
    from dask_kvstate.hints import parse_hints

    hints = parse_hints(config.get("scheduling.components"))
    if hints.limits or hints.batch:
        from dask_kvstate.plugins.scheduler.hints import ComponentHints

        wanted.append(ComponentHints())
    if not wanted and not config.get("scheduling.sessions"):
        return []
    return [SessionTracker(), *wanted, SchedulingWorkerPlugin()]


def install_scheduling(client: Client) -> list[str]:
    """Register the scheduling extensions switched on in ``kvstate.scheduling.*``.

    Needs no model: ``kvs.install`` calls it, and workflows of plain Python functions can
    call it alone. The sessions extension comes first (the others read it); with any
    extension on, every worker gets the ``kvstate-scheduling`` plugin (re-sorting its
    ready heap, taking capacity moves). Idempotent. Returns the names registered
    (an awaitable of them with an asynchronous client).
    """
    plugins = scheduling_plugins()
    if not plugins:
        return []
    if client.asynchronous:  # an asynchronous client: the caller awaits the registrations

        async def register() -> list[str]:
            for p in plugins:
                await client.register_plugin(p)
            return [p.name for p in plugins[:-1]]

        return register()
    for p in plugins:
        client.register_plugin(p)  # idempotent: a no-op when one of that name is there
    return [p.name for p in plugins[:-1]]


def _scheduling_stats(dask_scheduler) -> dict:
    out = {}
    for name in SCHEDULING_EXTENSIONS:
        plugin = dask_scheduler.plugins.get(name)
        out[name.removeprefix("kvstate-")] = (
            {"installed": False} if plugin is None else {"installed": True, **plugin.stats()}
        )
    return out


def scheduling_stats(client: Client) -> dict:
    """What the scheduling extensions did, and the global control loop's latency.

    ``{"sessions": {open, ended, sessions, recently_ended, control_loop, ...},
    "priority": {...}, "stealing": {moves, kept, affinity_kept, queued_seen, ...},
    "capacity": {moves, last, latency, ...}, "hints": {limits, running, held, peak, ...}}``;
    ``sessions.control_loop`` holds, per
    policy and in total, the pass latency (count, mean, p50, p99, max in ms). Never
    raises for an extension that is off: it reads ``{"installed": False}``.
    """
    return client.run_on_scheduler(_scheduling_stats)
