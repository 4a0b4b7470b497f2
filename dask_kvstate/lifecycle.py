"""Client side of the KV lifecycle (Nalar 4.5): register its extensions, read what it did."""

from __future__ import annotations

from distributed import Client


def lifecycle_plugins() -> list:
    """The session tracker (the extension needs it), the ``kvstate-lifecycle`` scheduler
    extension, then its worker plugin: shared by :func:`install_lifecycle` and the preload."""
    from dask_kvstate.plugins.scheduler.lifecycle import KVLifecycle
    from dask_kvstate.plugins.scheduler.sessions import SessionTracker
    from dask_kvstate.plugins.worker.lifecycle import KVLifecycleWorkerPlugin

    return [SessionTracker(), KVLifecycle(), KVLifecycleWorkerPlugin()]


def install_lifecycle(client: Client) -> list[str]:
    """Register the ``kvstate-lifecycle`` scheduler extension and its worker plugin.

    ``kvs.install`` calls it when ``kvstate.lifecycle.enabled`` is true, after the
    ``kvstate`` worker plugin (the lifecycle plugin times moves on that plugin's store).
    It needs the sessions extension and registers it first (idempotent). A synchronous
    client only. Returns the names registered.
    """
    plugins = lifecycle_plugins()
    for p in plugins:
        client.register_plugin(p)  # idempotent: a no-op when one of that name is there
    return [p.name for p in plugins]


def _lifecycle_stats(dask_scheduler) -> dict:
    from dask_kvstate.protocol import LIFECYCLE_EXTENSION

    plugin = dask_scheduler.plugins.get(LIFECYCLE_EXTENSION)
    return {"installed": False} if plugin is None else {"installed": True, **plugin.stats()}


def lifecycle_stats(client: Client) -> dict:
    """What the lifecycle extension did: offloads, prefetches, invalidations (bytes freed,
    left, shared per ended session and worker), component mean durations, and each
    worker's last report (session bytes per tier, measured move rates)."""
    return client.run_on_scheduler(_lifecycle_stats)
