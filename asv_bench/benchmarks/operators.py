"""Operator costs on one runtime: fork at every context length, and the local prefix cache.

``fork`` must stay O(1) in the context (the AAFLOW+ target: under 1 ms at every L);
the prefix cache's warm call must beat its cold one by the share of the prompt it hits.
"""

from __future__ import annotations

import time

from dask_kvstate.generation import Sampling

from .common import ModelSuite


class Fork(ModelSuite):
    params = ([512, 1024, 2048, 4096], [16])
    param_names = ["context_tokens", "k"]

    def setup(self, context_tokens, k):
        self.setup_model()
        self.rt = self.runtime()
        text = " ".join(f"w{i}" for i in range(context_tokens))  # any text; its token count is what we sweep
        self.ref = self.rt.materialize(self.backend.detokenize(self.token_ids(context_tokens)) or text, "bench")

    def teardown(self, context_tokens, k):
        self.rt.store.close()

    def time_fork(self, context_tokens, k):
        self.rt.fork(self.ref, k)

    def track_fork_us(self, context_tokens, k):
        best = float("inf")
        for _ in range(50):
            t0 = time.perf_counter()
            self.rt.fork(self.ref, k)
            best = min(best, time.perf_counter() - t0)
        return best * 1e6

    track_fork_us.unit = "us"


class PrefixCache(ModelSuite):
    params = ([256, 1024],)
    param_names = ["context_tokens"]

    def setup(self, context_tokens):
        self.setup_model()
        self.rt = self.runtime()
        self.context = self.backend.detokenize(self.token_ids(context_tokens))
        self.n = 0
        self._call(" question", "warm")  # time_warm's blocks, so even its first timed call (--quick) is warm

    def teardown(self, context_tokens):
        self.rt.store.close()

    def _call(self, suffix: str, namespace: str):
        return self.rt.generate_cached(self.context + suffix, namespace, Sampling(1))

    def time_cold(self, context_tokens):
        self.n += 1
        self._call(" question", f"cold-{self.n}")  # a fresh namespace: nothing to hit

    def time_warm(self, context_tokens):
        self._call(" question", "warm")

    def track_warm_speedup(self, context_tokens):
        cold, warm = [], []
        for i in range(3):
            t0 = time.perf_counter()
            self._call(" question", f"track-cold-{i}-{time.time()}")
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            self._call(" another question", "track-warm")
            warm.append(time.perf_counter() - t0)
        return min(cold) / min(warm[1:])

    track_warm_speedup.unit = "x"
