"""Model backends. One today: Hugging Face transformers (:class:`HFBackend`)."""

from __future__ import annotations

from dask_kvstate.backends.models import KNOWN_MODELS, check_model_name

__all__ = ["KNOWN_MODELS", "check_model_name", "load_backend"]


def load_backend(name: str, cache_dir: str | None = None, device: str | None = None):
    """Load the backend for a model name or folder.

    Raises ``ValueError`` listing the known names when ``name`` is unknown.
    """
    from dask_kvstate.backends.hf import HFBackend

    return HFBackend.load(name, cache_dir=cache_dir, device=device)
