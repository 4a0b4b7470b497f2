"""Model backends: Hugging Face transformers (:class:`~.hf.HFBackend`, the default) and vLLM
(:class:`~.vllm.VLLMBackend`), chosen by ``kvstate.backend``, both a :class:`~.base.Backend`.

Code outside this package reaches a backend only through the functions here, never by
importing a concrete one: the worker runtime sees the interface, and a module that needs
vLLM or transformers internals stays inside ``backends/``. Importing this module loads
neither torch nor an engine (the scheduler and the client read the model tables).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dask_kvstate.backends.models import (
    DTYPES,
    KNOWN_MODELS,
    check_dtype,
    check_model_name,
    check_supported,
    describe_known,
)

if TYPE_CHECKING:
    from dask_kvstate.backends.base import Backend
    from dask_kvstate.backends.vllm_cores import CoreShare

__all__ = [
    "BACKENDS",
    "DTYPES",
    "KNOWN_MODELS",
    "check_backend",
    "check_dtype",
    "check_model_name",
    "check_supported",
    "core_share",
    "describe_known",
    "from_model",
    "load_backend",
]

#: Values of ``kvstate.backend``.
BACKENDS = ("hf", "vllm")


def load_backend(name: str, cache_dir: str | None = None, device: str | None = None) -> Backend:
    """Load the ``kvstate.backend`` backend for a model name, folder or ``.gguf`` file, in ``kvstate.dtype``.

    Raises ``ValueError`` listing the known names when ``name`` is unknown, and naming
    the value when ``kvstate.dtype`` or ``kvstate.backend`` is not a known one.
    """
    from dask_kvstate import config

    kind = check_backend(config.get("backend"))
    if kind == "vllm":
        from dask_kvstate.backends.vllm import VLLMBackend

        return VLLMBackend.load(name, cache_dir=cache_dir, device=device)
    from dask_kvstate.backends.hf import HFBackend

    return HFBackend.load(name, cache_dir=cache_dir, device=device)


def from_model(name: str, model: Any, tokenizer: Any, device: str | None = None) -> Backend:
    """The transformers backend over a model built by the caller (a transformers causal LM and its tokenizer).

    For code that makes its own model, as the family kit and the dtype agreement benchmark
    do, whatever ``kvstate.backend`` says: an engine loads its model itself, from a name.
    Raises what the backend's load raises for a model it refuses.
    """
    from dask_kvstate.backends.hf import HFBackend

    return HFBackend(name, model, tokenizer, device)


def core_share(cores: str, directory: str | Path | None = None) -> CoreShare:
    """A claim on the board vLLM engines given ``cores`` share them by
    (:class:`~.vllm_cores.CoreShare`), for a process that is no engine (the tests' peers)."""
    from dask_kvstate.backends.vllm_cores import CoreShare

    return CoreShare(cores, directory)


def cores_of_this_process() -> str:
    """Every core this process may run on, as vLLM's binding spec (``"0,1"``); what an
    engine started here is given by default (:func:`~.vllm_cores.cores_of_this_process`)."""
    from dask_kvstate.backends.vllm_cores import cores_of_this_process

    return cores_of_this_process()


def check_backend(kind: str) -> str:
    """``kind`` if it is one of :data:`BACKENDS`, else ValueError naming it.

    >>> check_backend("vllm")
    'vllm'
    """
    if kind not in BACKENDS:
        raise ValueError(f"kvstate.backend must be one of {', '.join(BACKENDS)}, got {kind!r}")
    return kind
