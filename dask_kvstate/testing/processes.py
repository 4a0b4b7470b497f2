"""Dask worker processes forked from a server that has imported the heavy modules once.

``LocalCluster`` spawns its worker processes by default, so every worker of every
cluster imports torch, transformers and the worker plugin anew: about 15 seconds a
cluster on two cores, and the test suite and the asv suites start many short-lived
clusters. :func:`fork_worker_processes` makes this process start them from a
``multiprocessing`` fork server that imported those modules once, the way distributed's
own test suite does (its ``forkserver`` preload). What a test or a benchmark checks
happens inside running workers, after ``kvs.install``; how they were started changes
none of it.

A forked worker has the fork server's environment, not the environment of the process
that starts a cluster later: the fork server starts with the first worker, so set what
workers must inherit (UCX's settings, say) before that.
"""

from __future__ import annotations

from collections.abc import Sequence

#: What a forked worker process finds imported (distributed's own choice first). Only
#: imports: nothing here starts a thread or an OpenMP team, which a fork would not carry.
WORKER_PRELOAD = (
    "distributed",
    "numpy",
    "torch",
    "transformers.models.llama.modeling_llama",
    "dask_kvstate.plugins.worker.plugin",
)


def fork_worker_processes(preload: Sequence[str] = WORKER_PRELOAD) -> None:
    """Start this process's Dask worker processes from a fork server holding ``preload``."""
    import dask
    from distributed.utils import get_mp_context

    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    # distributed names its own preload on first use; this list replaces it (the fork
    # server starts with the first worker, so until then the list can change).
    get_mp_context().set_forkserver_preload(list(preload))
