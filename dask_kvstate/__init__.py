"""dask-kvstate: the KV cache of LLMs as a first-class object in Dask workflows.

Build workflows from the operators with ``dask.delayed`` semantics, attach the worker
plugin with :func:`install`, and compute with a ``distributed.Client``:

>>> import dask_kvstate as kvs
>>> context = kvs.materialize("You are a careful reviewer. ", "Shared document ...")
>>> answers = [kvs.resume(s, f"Question {i}?") for i, s in enumerate(kvs.fork(context, 2))]
>>> len(answers)
2
"""

from __future__ import annotations

from dask_kvstate import (
    config,  # noqa: F401  (registers the kvstate.* defaults)
    tasks,  # noqa: F401  (kvs.tasks.*: the operators for client.submit)
)
from dask_kvstate.backends import KNOWN_MODELS
from dask_kvstate.client import install, install_scheduling, placement_stats, scheduling_stats, stats
from dask_kvstate.errors import MergeError
from dask_kvstate.generation import Generation
from dask_kvstate.graph_opt import StateflowError, explain, optimize, stateflow
from dask_kvstate.hints import batchable
from dask_kvstate.lifecycle import install_lifecycle, lifecycle_stats
from dask_kvstate.operators import evict, extend, fork, generate, materialize, merge, resume, resume_many, transfer
from dask_kvstate.session import component, current_session, session
from dask_kvstate.state import KVState, KVStateRef, compatible

__version__ = "0.1.0"

__all__ = [
    "KNOWN_MODELS",
    "Generation",
    "KVState",
    "KVStateRef",
    "MergeError",
    "StateflowError",
    "batchable",
    "compatible",
    "component",
    "current_session",
    "evict",
    "explain",
    "extend",
    "fork",
    "generate",
    "install",
    "install_lifecycle",
    "install_scheduling",
    "lifecycle_stats",
    "materialize",
    "merge",
    "optimize",
    "placement_stats",
    "resume",
    "resume_many",
    "scheduling_stats",
    "session",
    "stateflow",
    "stats",
    "transfer",
]
