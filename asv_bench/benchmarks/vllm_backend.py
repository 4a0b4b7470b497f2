"""The vLLM backend against vLLM itself: a state loaded into an engine by our connector vs
the engine's own prefix cache (hit) and its text replay (cold), same engine, same prompts.

Skipped, by name, where the ``vllm`` extra is not installed. The engine starts once in
``setup_cache`` (tens of seconds) and every figure is measured there, so no benchmark
process starts another engine.
"""

from __future__ import annotations

import statistics

from dask_kvstate.generation import Sampling

from . import common


class VLLMResume:
    params = ([1024],)
    param_names = ["context_tokens"]
    timeout = 420

    def setup_cache(self):
        common.require_backend("vllm")
        import dask

        # Eager (a ~15 s start): the figures compare the engine with itself, compiled or not.
        with dask.config.set({"kvstate.block-tokens": 64, "kvstate.vllm.compile": False}):
            backend = common.backend("smollm2-135m", "vllm")
        words = ("the planner writes a plan and the tester runs the tests " * 400).split()
        ids = backend.tokenize(" ".join(words))
        out = {}
        for n in self.params[0]:
            prefix = ids[:n]
            prompt = prefix + backend.tokenize(" question: who tests?")
            kv, _ = backend.prefill(prefix)
            cold, hit, loaded = [], [], []
            for _ in range(3):
                backend.reset_engine_cache()
                replay = backend.generate(prompt, None, Sampling(1))
                cold.append(replay.ttft)
                hit.append(backend.generate(prompt, None, Sampling(1)).ttft)
                backend.reset_engine_cache()
                resumed = backend.generate(prompt, kv, Sampling(1))
                if resumed.token_ids != replay.token_ids:
                    raise AssertionError("a resume from loaded KV differs from the engine's own replay")
                loaded.append(resumed.ttft)
            out[n] = {k: statistics.median(v) for k, v in (("cold", cold), ("hit", hit), ("loaded", loaded))}
        backend.close()
        return out

    def setup(self, cache, context_tokens):
        common.require_backend("vllm")

    def track_ttft_loaded_s(self, cache, context_tokens):
        return cache[context_tokens]["loaded"]

    track_ttft_loaded_s.unit = "s"

    def track_loaded_vs_replay_speedup(self, cache, context_tokens):
        return cache[context_tokens]["cold"] / cache[context_tokens]["loaded"]

    track_loaded_vs_replay_speedup.unit = "vLLM text replay TTFT / TTFT from loaded KV"

    def track_loaded_vs_prefix_hit(self, cache, context_tokens):
        return cache[context_tokens]["loaded"] / cache[context_tokens]["hit"]

    track_loaded_vs_prefix_hit.unit = "TTFT from loaded KV / vLLM prefix-cache hit"
