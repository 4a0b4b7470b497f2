"""The transformers backend's kernels, switched on one loaded SmolLM2 (``bench/hf_kernels.py``,
whose command times more shapes).

``PackedLinear``: its linear layers as transformers runs them vs oneDNN-packed with fused
MLPs: ``track_decode_s`` is 16 siblings decoded as one batch over a 256-token state (the
best of three), ``track_decode_speedup`` plain / this mode's time, ``track_identical`` 1
when this mode gives plain transformers' tokens. ``VLLMAttention``: its attention, torch's
or vLLM's CPU kernel.

Each suite loads the model once and measures every mode in ``setup_cache``, its tracks
reading the results: one process per benchmark (asv's way) would load and pack the model
once per track and mode, most of this file's time in the suite.
"""

from __future__ import annotations

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


def _best_of_three(run):
    """The shortest of three walls of ``run()`` (:func:`~dask_kvstate.bench.profile_resume.best`),
    and what its last call returned."""
    from dask_kvstate.bench.profile_resume import best

    returned = []
    wall = best(lambda: returned.append(run()))
    return wall, returned[-1]


class PackedLinear:
    params = (["plain", "fused"],)
    param_names = ["linear_layers"]
    timeout = 300
    siblings, context_tokens, new_tokens = 16, 256, 8

    def setup_cache(self):
        """Each mode's best decode wall and tokens, on one loaded model (packing is never timed)."""
        import dask

        from dask_kvstate.backends import load_backend
        from dask_kvstate.backends.batch import generate_batch
        from dask_kvstate.bench.hf_kernels import switch

        with dask.config.set({"kvstate.backend": "hf", "kvstate.hf.packed-linear": False}):
            backend = load_backend("smollm2-135m")
        _, kv, rows = siblings_over_a_state(backend, self.context_tokens, self.siblings)
        runs = {}
        for mode in self.params[0]:
            switch(backend, mode)
            wall, out = _best_of_three(lambda: generate_batch(backend, rows, kv, Sampling(self.new_tokens)))
            runs[mode] = {"wall_s": wall, "tokens": [r.token_ids for r in out]}
        return runs

    def track_decode_s(self, runs, mode):
        return runs[mode]["wall_s"]

    track_decode_s.unit = "s"

    def track_decode_speedup(self, runs, mode):
        """Plain's time over this mode's (1 for plain itself)."""
        return runs["plain"]["wall_s"] / runs[mode]["wall_s"]

    track_decode_speedup.unit = "x"

    def track_identical(self, runs, mode):
        return float(runs[mode]["tokens"] == runs["plain"]["tokens"])

    track_identical.unit = "1 = token-identical"


class VLLMAttention:
    """The transformers backend's attention through vLLM's CPU kernel (a prompt over itself,
    siblings over shared pages; ``bench/hf_kernels.py``'s fourth mode) against torch's, on
    one loaded SmolLM2: ``track_speedup`` torch / kernel for a 512-token prefill and 8
    siblings' 8 tokens over it (the best of three each), ``track_identical`` 1 when the
    kernel gives torch's tokens. Only ratios, measured inside (the whole asv run's time).
    Skipped where vLLM is not installed or refuses the model's shapes, saying why."""

    timeout = 300
    siblings, context_tokens, new_tokens = 8, 512, 8

    def setup_cache(self):
        from dask_kvstate.backends import load_backend
        from dask_kvstate.backends.batch import generate_batch
        from dask_kvstate.bench.hf_kernels import VLLM_ATTENTION, switch

        from .common import missing

        reason = missing("vllm")
        if reason:
            return {"skip": reason}
        backend = load_backend("smollm2-135m")
        kernel = backend.cpu_attention
        if kernel is None:
            return {"skip": backend.cpu_attention_note}
        prompt, kv, rows = siblings_over_a_state(backend, self.context_tokens, self.siblings)

        def prefill_and_siblings():
            backend.prefill(prompt)
            return generate_batch(backend, rows, kv, Sampling(self.new_tokens))

        runs = {}
        for name, mode in (("torch", "fused"), ("kernel", VLLM_ATTENTION)):
            switch(backend, mode, kernel)
            wall, out = _best_of_three(prefill_and_siblings)
            runs[name] = {"wall_s": wall, "tokens": [r.token_ids for r in out]}
        return runs

    def setup(self, runs):
        if "skip" in runs:
            raise NotImplementedError(runs["skip"])  # asv: skipped, saying why

    def track_speedup(self, runs):
        return runs["torch"]["wall_s"] / runs["kernel"]["wall_s"]

    track_speedup.unit = "x"

    def track_identical(self, runs):
        return float(runs["kernel"]["tokens"] == runs["torch"]["tokens"])

    track_identical.unit = "1 = token-identical"
