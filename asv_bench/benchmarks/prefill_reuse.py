"""Prefill reuse on one backend, in process: resume from a state vs text replay.

Both sides run in the same benchmark process on the same seeded prompts, so the
ratio ``track_ttft_speedup`` compares like with like. The cluster-level experiments
(TTFT vs context, agent scaling, transfer vs recompute) build on this suite.
"""

from __future__ import annotations

import time

from dask_kvstate.generation import Sampling

from . import common


class PrefillReuse:
    params = ([256, 1024], ["tiny-llama"])
    param_names = ["context_tokens", "model"]
    timeout = 300

    def setup(self, context_tokens, model):
        self.backend = common.backend(model)
        words = ("the planner writes a plan and the tester runs the tests " * 400).split()
        ids = self.backend.tokenize(" ".join(words))
        self.prefix = ids[:context_tokens]
        self.prompt = self.prefix + self.backend.tokenize(" question: who tests?")
        cache, _ = self.backend.prefill(self.prefix)
        self.kv = self.backend.kv_from_cache(cache)

    def time_text_replay(self, context_tokens, model):
        self.backend.generate(self.prompt, None, Sampling(1))

    def time_resume_from_state(self, context_tokens, model):
        self.backend.generate(self.prompt, self.kv, Sampling(1))

    def track_ttft_speedup(self, context_tokens, model):
        def best(past):
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                self.backend.generate(self.prompt, past, Sampling(1))
                runs.append(time.perf_counter() - t0)
            return min(runs)

        return best(None) / best(self.kv)

    track_ttft_speedup.unit = "x"
