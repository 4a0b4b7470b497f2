"""Worker, nanny and scheduler plugins (installed as ``dask_kvstate.plugins``).

Also a Dask preload, for clusters started from the command line (dask-jobqueue,
Kubernetes, ``dask scheduler`` / ``dask worker`` by hand)::

    dask scheduler --preload dask_kvstate.plugins
    DASK_KVSTATE__MODEL=tiny-llama dask worker tcp://scheduler:8786 --preload dask_kvstate.plugins \
        --preload-nanny dask_kvstate.plugins

so that every worker has its model and block store before it takes its first task, and
no client has to call ``kvs.install``. Settings come from the ``kvstate.*`` Dask config
of the process (YAML files or ``DASK_KVSTATE__...`` environment variables).
"""

from __future__ import annotations


async def dask_setup(server) -> None:
    """Preload hook (``--preload dask_kvstate.plugins``): attach the kvstate plugins.

    The same plugins ``kvs.install`` registers, built by the same function
    (:func:`dask_kvstate.extensions.extensions`) from this process's config. On a worker:
    the ``kvstate`` worker plugin with ``kvstate.model`` (a list of models in
    ``DASK_KVSTATE__MODEL='["a", "b"]'`` loads several) and the budgets and threads of
    ``kvstate.worker.*``, then the worker halves of the enabled extensions. On a scheduler:
    every extension whose ``enabled`` key is on (placement, observe, sessions and the
    scheduling policies, lifecycle). A bad setting fails the preload with the plugin's
    ValueError, which distributed logs (``Failed to start preload``) and the worker then
    runs without the plugin; ``kvs.install`` from a client still works. On each of them,
    and on a nanny (``--preload-nanny``), the plugin that runs Dask's own periodic checks
    less often (:mod:`.housekeeping`), unless ``kvstate.housekeeping.enabled`` is false.
    """
    from distributed import Nanny, Scheduler, Worker

    from dask_kvstate import config
    from dask_kvstate.extensions import enabled, extensions
    from dask_kvstate.plugins import housekeeping

    quieter = housekeeping.plugin_for(server)
    if isinstance(server, Nanny):
        if quieter is not None:
            await server.plugin_add(quieter)
    elif isinstance(server, Worker):
        from dask_kvstate.plugins.worker.plugin import KVStateWorkerPlugin

        # The plugin reads every setting from the config when it is built, as kvs.install's does.
        plugin = KVStateWorkerPlugin(config.get("model"))
        # catch_errors=False: a model that fails to load must fail the preload loudly.
        await server.plugin_add(plugin, name=KVStateWorkerPlugin.name, catch_errors=False)
        for half in extensions(enabled()).worker:  # after the kvstate plugin: the lifecycle half uses its store
            await server.plugin_add(half, catch_errors=False)
        if quieter is not None:  # last, as kvs.install: a model that fails to load leaves Dask's timers
            await server.plugin_add(quieter, catch_errors=False)
    elif isinstance(server, Scheduler):
        import dask.config

        config.check(dask.config.get("kvstate"))
        if quieter is not None:
            server.add_plugin(quieter)
        for extension in extensions(enabled()).scheduler:
            server.add_plugin(extension)
    else:
        raise TypeError(
            f"dask_kvstate.plugins preloads a Worker, a Nanny or a Scheduler, not a {type(server).__name__}"
        )
