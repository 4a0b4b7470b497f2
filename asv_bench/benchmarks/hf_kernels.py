"""The transformers backend's kernels, switched on one loaded SmolLM2 (``bench/hf_kernels.py``,
whose command times more shapes).

``PackedLinear``: its linear layers as transformers runs them vs oneDNN-packed with fused
MLPs; ``time_decode`` is 16 siblings decoded as one batch over a 256-token state,
``track_decode_speedup`` plain / this mode's time, ``track_identical`` 1 when this mode
gives plain transformers' tokens. ``VLLMAttention``: its attention, torch's or vLLM's CPU
kernel.
"""

from __future__ import annotations

import time

from dask_kvstate.generation import Sampling

from .common import SEED


def siblings_over_a_state(backend, context_tokens: int, siblings: int):
    """A seeded random context, its state's KV, and ``siblings`` rows each keeping the whole
    context and adding 4, 5, ... tokens of their own."""
    import torch

    from dask_kvstate.backends.batch import Row

    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(16, 40000, (context_tokens + siblings + 8,), generator=gen).tolist()
    context = ids[:context_tokens]
    kv = backend.kv_from_cache(backend.prefill(context)[0])
    rows = [Row(context + ids[context_tokens : context_tokens + 4 + i], context_tokens) for i in range(siblings)]
    return context, kv, rows


class PackedLinear:
    params = (["plain", "fused"],)
    param_names = ["linear_layers"]
    timeout = 300
    siblings, context_tokens, new_tokens = 16, 256, 8

    def setup(self, mode):
        import dask

        from dask_kvstate.backends import load_backend

        with dask.config.set({"kvstate.backend": "hf", "kvstate.hf.packed-linear": False}):
            self.backend = load_backend("smollm2-135m")
        _, self.kv, self.rows = siblings_over_a_state(self.backend, self.context_tokens, self.siblings)
        self._switch(mode)

    def _switch(self, mode: str) -> None:
        from dask_kvstate.bench.hf_kernels import switch

        switch(self.backend, mode)  # packing is setup, never timed (torch's attention in both)

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


class VLLMAttention:
    """The transformers backend's attention through vLLM's CPU kernel (a prompt over itself,
    siblings over shared pages; ``bench/hf_kernels.py``'s fourth mode) against torch's, on
    one loaded SmolLM2: ``track_speedup`` torch / kernel for a 512-token prefill and 8
    siblings' 8 tokens over it, ``track_identical`` 1 when the kernel gives torch's tokens.
    Only ratios, measured inside (the whole asv run's time). Skipped where vLLM is not installed."""

    timeout = 300
    siblings, context_tokens, new_tokens = 8, 512, 8

    def setup(self):

        from dask_kvstate.backends import load_backend
        from dask_kvstate.bench.hf_kernels import switch

        from .common import require_backend

        require_backend("vllm")
        self.backend = load_backend("smollm2-135m")
        kernel = self.backend.cpu_attention
        if kernel is None:
            raise NotImplementedError(self.backend.cpu_attention_note)  # asv: skipped, saying why
        self.use = lambda on: switch(self.backend, "fused+vllm-attention" if on else "fused", kernel)
        self.prompt, self.kv, self.rows = siblings_over_a_state(self.backend, self.context_tokens, self.siblings)

    def _run(self, kernel: bool) -> tuple[float, list[list[int]]]:
        """The best of three prefill + siblings walls, and the siblings' tokens."""
        from dask_kvstate.backends.batch import generate_batch

        self.use(kernel)
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            self.backend.prefill(self.prompt)
            res = generate_batch(self.backend, self.rows, self.kv, Sampling(self.new_tokens))
            walls.append(time.perf_counter() - t0)
        return min(walls), [r.token_ids for r in res]

    def track_speedup(self):
        return self._run(False)[0] / self._run(True)[0]

    track_speedup.unit = "x"

    def track_identical(self):
        return float(self._run(True)[1] == self._run(False)[1])

    track_identical.unit = "1 = token-identical"
