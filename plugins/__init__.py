"""Worker and scheduler plugins (installed as ``dask_kvstate.plugins``).

Also a Dask preload, for clusters started from the command line (dask-jobqueue,
Kubernetes, ``dask scheduler`` / ``dask worker`` by hand)::

    dask scheduler --preload dask_kvstate.plugins
    DASK_KVSTATE__MODEL=tiny-llama dask worker tcp://scheduler:8786 --preload dask_kvstate.plugins

so that every worker has its model and block store before it takes its first task, and
no client has to call ``kvs.install``. Settings come from the ``kvstate.*`` Dask config
of the process (YAML files or ``DASK_KVSTATE__...`` environment variables).
"""

from __future__ import annotations


async def dask_setup(server) -> None:
    """Preload hook (``--preload dask_kvstate.plugins``): attach the kvstate plugins.

    On a worker: the ``kvstate`` worker plugin with ``kvstate.model`` (a list of models
    in ``DASK_KVSTATE__MODEL='["a", "b"]'`` loads several) and the budgets and threads of
    ``kvstate.worker.*``, and the scheduling worker plugin when ``kvstate.scheduling``
    switches any extension on. On a scheduler: the placement extension (unless
    ``kvstate.placement.enabled`` is false), the observe extension (the ``/kvstate``
    page), the scheduling extensions and, when ``kvstate.lifecycle.enabled``, the KV
    lifecycle pair: what ``kvs.install`` registers. A bad setting fails the preload with the
    plugin's ValueError, which distributed logs (``Failed to start preload``) and the
    worker then runs without the plugin; ``kvs.install`` from a client still works.
    """
    from distributed import Scheduler, Worker

    from dask_kvstate import config
    from dask_kvstate.client import scheduling_plugins
    from dask_kvstate.lifecycle import lifecycle_plugins

    # The same plugins kvs.install registers, from this process's config.
    scheduling = scheduling_plugins()  # [scheduler extensions..., worker plugin] or []
    lifecycle = lifecycle_plugins() if config.get("lifecycle.enabled") else []  # the same shape
    if isinstance(server, Worker):
        from dask_kvstate.plugins.worker.plugin import KVStateWorkerPlugin

        # The plugin reads every setting from the config when it is built, as kvs.install's does.
        plugin = KVStateWorkerPlugin(config.get("model"))
        # catch_errors=False: a model that fails to load must fail the preload loudly.
        await server.plugin_add(plugin, name=plugin.name, catch_errors=False)
        if scheduling:
            await server.plugin_add(scheduling[-1], catch_errors=False)
        if lifecycle:  # after the kvstate plugin: it times moves on its store
            await server.plugin_add(lifecycle[-1], catch_errors=False)
    elif isinstance(server, Scheduler):
        import dask.config

        from dask_kvstate.plugins.scheduler.observe import KVObserver

        config.check(dask.config.get("kvstate"))
        if config.get("placement.enabled"):
            from dask_kvstate.plugins.scheduler.placement import KVPlacement

            server.add_plugin(KVPlacement())
        server.add_plugin(KVObserver())
        for extension in scheduling[:-1]:
            server.add_plugin(extension)
        for extension in lifecycle[:-1]:
            if extension.name not in server.plugins:  # the session tracker may be there already
                server.add_plugin(extension)
    else:
        raise TypeError(f"dask_kvstate.plugins preloads a Worker or a Scheduler, not a {type(server).__name__}")
