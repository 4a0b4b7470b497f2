"""Model backends: Hugging Face transformers (:class:`~.hf.HFBackend`, the default) and vLLM
(:class:`~.vllm.VLLMBackend`), chosen by ``kvstate.backend``."""

from __future__ import annotations

from dask_kvstate.backends.models import (
    DTYPES,
    KNOWN_MODELS,
    check_dtype,
    check_model_name,
    check_supported,
    describe_known,
)

__all__ = [
    "BACKENDS",
    "DTYPES",
    "KNOWN_MODELS",
    "check_backend",
    "check_dtype",
    "check_model_name",
    "check_supported",
    "describe_known",
    "load_backend",
]

#: Values of ``kvstate.backend``.
BACKENDS = ("hf", "vllm")


def load_backend(name: str, cache_dir: str | None = None, device: str | None = None):
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


def check_backend(kind: str) -> str:
    """``kind`` if it is one of :data:`BACKENDS`, else ValueError naming it.

    >>> check_backend("vllm")
    'vllm'
    """
    if kind not in BACKENDS:
        raise ValueError(f"kvstate.backend must be one of {', '.join(BACKENDS)}, got {kind!r}")
    return kind
