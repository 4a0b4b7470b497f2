"""Model backends. One today: Hugging Face transformers (:class:`HFBackend`)."""

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
    "DTYPES",
    "KNOWN_MODELS",
    "check_dtype",
    "check_model_name",
    "check_supported",
    "describe_known",
    "load_backend",
]


def load_backend(name: str, cache_dir: str | None = None, device: str | None = None):
    """Load the backend for a model name, folder or ``.gguf`` file, in the dtype ``kvstate.dtype`` names.

    Raises ``ValueError`` listing the known names when ``name`` is unknown, and naming
    the value when ``kvstate.dtype`` is not one of :data:`DTYPES`.
    """
    from dask_kvstate.backends.hf import HFBackend

    return HFBackend.load(name, cache_dir=cache_dir, device=device)
