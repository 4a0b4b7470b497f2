"""A shared suite base: one backend per benchmark process and seeded inputs.

Every suite that needs a model derives from :class:`ModelSuite`; its prompts are
seeded token ids (no text to drift), so every commit benchmarks the same work.
"""

from __future__ import annotations

import tempfile

SEED = 0
_BACKENDS: dict = {}


def backend(model: str = "tiny-llama"):
    """One loaded backend per process and model (loading is setup, never timed)."""
    if model not in _BACKENDS:
        from dask_kvstate.backends import load_backend

        _BACKENDS[model] = load_backend(model)
    return _BACKENDS[model]


class ModelSuite:
    """Base: ``self.backend`` and seeded token ids; ``runtime()`` for operator-level suites."""

    model = "tiny-llama"
    timeout = 300

    def setup_model(self, seed: int = SEED):
        import torch

        self.backend = backend(self.model)
        self.vocab = int(getattr(self.backend.config, "vocab_size", 1000))
        self.generator = torch.Generator().manual_seed(seed)

    def token_ids(self, n: int) -> list[int]:
        import torch

        # Skip the first ids: special tokens (end of text) would stop decoding early.
        return torch.randint(16, self.vocab, (n,), generator=self.generator).tolist()

    def runtime(self):
        """A worker-less StateRuntime over a fresh in-memory block store."""
        from dask_kvstate.plugins.worker.block_store import TieredBlockStore
        from dask_kvstate.plugins.worker.runtime import StateRuntime

        self._dir = tempfile.mkdtemp()
        store = TieredBlockStore(self._dir, device_bytes=2**30, host_bytes=2**30, disk_bytes=2**30)
        return StateRuntime(self.backend, store)
