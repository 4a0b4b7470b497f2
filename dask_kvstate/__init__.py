"""dask-kvstate: the KV cache of LLMs as a first-class object in Dask workflows.

>>> import dask_kvstate as kvs
>>> sorted(n for n in kvs.__all__ if not n[0].isupper())[:4]
['evict', 'extend', 'fork', 'generate']
"""
from __future__ import annotations

from dask_kvstate import config  # registers the kvstate.* defaults
from dask_kvstate.backends import KNOWN_MODELS
from dask_kvstate.client import install, stats
from dask_kvstate.generation import Generation
from dask_kvstate import tasks
from dask_kvstate.operators import evict, extend, fork, generate, materialize, merge, resume, transfer
from dask_kvstate.errors import MergeError
from dask_kvstate.state import KVStateRef, compatible

__version__ = "0.1.0"

__all__ = [
    "KNOWN_MODELS",
    "Generation",
    "KVStateRef",
    "MergeError",
    "compatible",
    "evict",
    "extend",
    "fork",
    "generate",
    "install",
    "materialize",
    "merge",
    "resume",
    "stats",
    "transfer",
]
