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
from dask_kvstate.backends import KNOWN_MODELS  # noqa: F401
from dask_kvstate.client import (  # noqa: F401  (the deprecated aliases, kept importable one release)
    install,
    install_lifecycle,
    install_scheduling,
    lifecycle_stats,
    placement_stats,
    scheduling_stats,
    stats,
)
from dask_kvstate.errors import MergeError
from dask_kvstate.generation import Generation
from dask_kvstate.graph_opt import StateflowError, explain, optimize, stateflow  # noqa: F401
from dask_kvstate.hints import batchable  # noqa: F401
from dask_kvstate.operators import (  # noqa: F401
    evict,
    extend,
    fork,
    generate,
    materialize,
    merge,
    resume,
    resume_many,
    transfer,
)
from dask_kvstate.session import component, current_session, session  # noqa: F401
from dask_kvstate.state import KVState, KVStateRef, compatible  # noqa: F401
from dask_kvstate.views import Stats

__version__ = "0.1.0"

# The public API: install, the operators, stateflow/explain, session and stats, with the
# types and errors they hand out. Also importable, outside it: helpers the compiler, hints
# and tests use (resume_many, batchable, component, current_session, compatible, optimize,
# tasks, KNOWN_MODELS) and the deprecated aliases of install and stats.
__all__ = [
    "Generation",
    "KVState",
    "KVStateRef",
    "MergeError",
    "StateflowError",
    "Stats",
    "evict",
    "explain",
    "extend",
    "fork",
    "generate",
    "install",
    "materialize",
    "merge",
    "resume",
    "session",
    "stateflow",
    "stats",
    "transfer",
]
