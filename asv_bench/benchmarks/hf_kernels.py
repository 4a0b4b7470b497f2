"""The transformers backend's linear layers: as transformers runs them vs oneDNN-packed with fused MLPs.

One loaded SmolLM2 switched between the two (``bench/hf_kernels.py``, whose command
times more shapes); ``time_decode`` is 16 siblings decoded as one batch over a 256-token
state, ``track_decode_speedup`` plain / this mode's time, ``track_identical`` 1 when
this mode gives plain transformers' tokens.
"""

from __future__ import annotations

import time

from dask_kvstate.generation import Sampling

from .common import SEED


class PackedLinear:
    params = (["plain", "fused"],)
    param_names = ["linear_layers"]
    timeout = 300
    siblings, context_tokens, new_tokens = 16, 256, 8

    def setup(self, mode):
        import dask
        import torch

        from dask_kvstate.backends import load_backend
        from dask_kvstate.backends.batch import Row

        with dask.config.set({"kvstate.backend": "hf", "kvstate.hf.packed-linear": False}):
            self.backend = load_backend("smollm2-135m")
        gen = torch.Generator().manual_seed(SEED)
        ids = torch.randint(16, 40000, (self.context_tokens + self.siblings + 8,), generator=gen).tolist()
        prefix = ids[: self.context_tokens]
        self.kv = self.backend.kv_from_cache(self.backend.prefill(prefix)[0])
        self._switch(mode)
        self.rows = [
            Row(prefix + ids[self.context_tokens : self.context_tokens + 4 + i], len(prefix))
            for i in range(self.siblings)
        ]

    def _switch(self, mode: str) -> None:
        from dask_kvstate.bench.hf_kernels import switch

        switch(self.backend.model, mode)  # packing is setup, never timed

    def _decode(self):
        from dask_kvstate.backends.batch import generate_batch

        return generate_batch(self.backend, self.rows, self.kv, Sampling(self.new_tokens))

    def time_decode(self, mode):
        self._decode()

    def track_decode_speedup(self, mode):
        """This mode against the other (plain / fused for fused; 1 for plain itself)."""

        def best():
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                self._decode()
                runs.append(time.perf_counter() - t0)
            return min(runs)

        if mode == "plain":
            return 1.0
        mine = best()
        self._switch("plain")
        plain = best()
        self._switch(mode)
        return plain / mine

    track_decode_speedup.unit = "x"

    def track_identical(self, mode):
        mine = [r.token_ids for r in self._decode()]
        self._switch("plain")
        plain = [r.token_ids for r in self._decode()]
        self._switch(mode)
        return float(mine == plain)

    track_identical.unit = "1 = token-identical"
