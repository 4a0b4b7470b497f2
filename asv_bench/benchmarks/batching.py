"""Batched siblings: k resumes from one state decoded together vs one after another.

Both sides decode the same seeded rows in the same process; ``track_speedup`` is
unbatched / batched time, ``track_identical`` is 1 when every row's tokens match.
"""

from __future__ import annotations

import time

from dask_kvstate.generation import Sampling

from .common import ModelSuite


class SiblingDecode(ModelSuite):
    params = ([1, 4, 16], [256, 1024])
    param_names = ["siblings", "context_tokens"]
    new_tokens = 16

    def setup(self, siblings, context_tokens):
        from dask_kvstate.backends.batch import Row

        self.setup_model()
        prefix = self.token_ids(context_tokens)
        self.kv = self.backend.kv_from_cache(self.backend.prefill(prefix)[0])
        # Suffixes of different lengths (8..8+siblings tokens): rows need padding.
        self.rows = [Row(prefix + self.token_ids(8 + i), len(prefix)) for i in range(siblings)]

    def _batched(self):
        from dask_kvstate.backends.batch import generate_batch

        return generate_batch(self.backend, self.rows, self.kv, Sampling(self.new_tokens))

    def _unbatched(self):
        # transformers' own cache, one row after another: what a resume did before batching.
        return [self.backend.generate(r.ids, self.kv, Sampling(self.new_tokens)) for r in self.rows]

    def time_batched(self, siblings, context_tokens):
        self._batched()

    def time_unbatched(self, siblings, context_tokens):
        self._unbatched()

    def peakmem_batched(self, siblings, context_tokens):
        self._batched()

    def peakmem_unbatched(self, siblings, context_tokens):
        self._unbatched()

    def track_speedup(self, siblings, context_tokens):
        def best(f):
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                f()
                runs.append(time.perf_counter() - t0)
            return min(runs)

        return best(self._unbatched) / best(self._batched)

    track_speedup.unit = "x"

    def track_identical(self, siblings, context_tokens):
        return float([r.token_ids for r in self._batched()] == [r.token_ids for r in self._unbatched()])

    track_identical.unit = "1 = token-identical"
