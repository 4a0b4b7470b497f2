"""What every suite shares: one backend per benchmark process, seeded inputs, skips.

Every suite that needs a model derives from :class:`ModelSuite`; its prompts are
seeded token ids (no text to drift), so every commit benchmarks the same work.

asv starts a process per benchmark and parameter combination, forked from a server
that imported the suite once (``launch_method: forkserver`` in ``asv.conf.json``).
The imports below are the slow part of a model suite's setup (seconds for torch and
transformers' Llama modelling code, against milliseconds to build tiny-llama), so
they happen here, at import, once for the whole run.

Cluster suites start worker processes the same way, for the same reason: from a
``multiprocessing`` fork server that has imported torch, transformers' Llama code and
the worker plugin (:func:`fork_worker_processes`). Spawned, every worker of every
cluster imports them anew, about 15 seconds a cluster on two cores, and a spawned
worker that has loaded a model takes 4 seconds to be killed at close. What the suites
time happens inside running workers, after ``kvs.install``: how they were started
changes none of it.

Benchmark processes run torch on :data:`TORCH_THREADS` thread, as every cluster
suite's workers do (``kvs.install(..., torch_threads=1)``): an in-process suite times
one worker's work. With torch's default of one thread per core on two cores shared
with other work, ``batching.SiblingDecode`` took 7 times as long (1.8 minutes against
14 seconds, same load), most of it threads waiting for a core.

A suite parametrized over model backends adds ``"backend"`` to its ``param_names``
with ``list(BACKENDS)`` as the values and passes the value to
:meth:`ModelSuite.setup_model` (or :func:`require_backend` for a cluster suite): a
backend whose package is not installed is then skipped in ``setup``, by name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile

import dask
import torch
import transformers.models.llama.modeling_llama  # noqa: F401  (imported once in the fork server, see above)

import dask_kvstate.backends.hf  # noqa: F401
from dask_kvstate.testing import processes

SEED = 0
TORCH_THREADS = 1
DEFAULT_BACKEND = "transformers"
#: Backend name (the value of ``kvstate.backend``) -> the optional package it needs,
#: None for one that dask-kvstate itself requires.
BACKENDS: dict[str, str | None] = {DEFAULT_BACKEND: None, "vllm": "vllm"}
#: Comm protocol -> the optional package it needs.
COMMS: dict[str, str | None] = {"tcp": None, "tls": None, "ucx": "distributed_ucxx"}
_BACKENDS: dict = {}


def fork_worker_processes() -> None:
    """Start this process's Dask worker processes from a fork server holding the worker's imports.

    A forked worker has its fork server's environment, not the environment of the
    process that starts the cluster: UCX's settings (loopback TCP and shared memory on
    a machine without RDMA, as ``crossover.two_workers`` sets them) are set here, before
    the fork server starts, so a UCX cluster made later still gets them.
    """
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    processes.fork_worker_processes()


fork_worker_processes()
torch.set_num_threads(TORCH_THREADS)


def missing(package: str | None) -> str | None:
    """Why a benchmark needing ``package`` cannot run here, or None when it can (or needs none)."""
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return f"{package} is not installed"


def require(package: str | None) -> None:
    """Skip (asv: NotImplementedError raised in ``setup``) when ``package`` is not installed."""
    reason = missing(package)
    if reason:
        raise NotImplementedError(reason)


def require_backend(name: str) -> None:
    """Skip when backend ``name``'s package is not installed; ValueError for an unknown name."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    require(BACKENDS[name])


def backend_config(name: str):
    """The config under which backend ``name`` loads (nothing to set for the default)."""
    if name == DEFAULT_BACKEND:
        return contextlib.nullcontext()

    return dask.config.set({"kvstate.backend": name})


def backend(model: str = "tiny-llama", name: str = DEFAULT_BACKEND):
    """One loaded backend per process, model and backend (loading is setup, never timed)."""
    if (name, model) not in _BACKENDS:
        from dask_kvstate.backends import load_backend

        require_backend(name)
        with backend_config(name):
            _BACKENDS[name, model] = load_backend(model)
    return _BACKENDS[name, model]


class ModelSuite:
    """Base: ``self.backend`` and seeded token ids; ``runtime()`` for operator-level suites."""

    model = "tiny-llama"
    timeout = 300

    def setup_model(self, seed: int = SEED, backend_name: str = DEFAULT_BACKEND):
        self.backend = backend(self.model, backend_name)
        self.vocab = int(getattr(self.backend.config, "vocab_size", 1000))
        self.generator = torch.Generator().manual_seed(seed)

    def token_ids(self, n: int) -> list[int]:
        # Skip the first ids: special tokens (end of text) would stop decoding early.
        return torch.randint(16, self.vocab, (n,), generator=self.generator).tolist()

    def runtime(self):
        """A worker-less StateRuntime over a fresh in-memory block store."""
        from dask_kvstate.plugins.worker.block_store import TieredBlockStore
        from dask_kvstate.plugins.worker.runtime import StateRuntime

        self._dir = tempfile.mkdtemp()
        store = TieredBlockStore(self._dir, device_bytes=2**30, host_bytes=2**30, disk_bytes=2**30)
        return StateRuntime(self.backend, store)
