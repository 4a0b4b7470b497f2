"""KV lifecycle (Nalar 4.5): resume latency, recomputes and leftovers against an LRU-only store.

All three configurations run in the same benchmark process on the same seeded sessions
(:mod:`dask_kvstate.bench.kv_lifecycle`): ``track_resume_vs_resident`` is the lifecycle's median
resume latency over a resident store's (target <= 1.1), ``track_lru_resume_vs_resident``
the same for the LRU-only store at the same budget, ``track_recomputes_*`` the blocks
rebuilt, ``track_ended_bytes_left`` the KV bytes ended sessions left behind.
"""

from __future__ import annotations

from dask_kvstate.bench import kv_lifecycle

from . import common  # noqa: F401  (its worker processes: see common.fork_worker_processes)


class Lifecycle:
    timeout = 600
    number = 1
    repeat = 1

    def setup_cache(self):
        return {r["config"]: r for r in kv_lifecycle.run(kv_lifecycle.Options(repeats=1))}

    def track_resume_vs_resident(self, rows):
        return rows["lifecycle"]["ttft_p50"] / rows["resident"]["ttft_p50"]

    track_resume_vs_resident.unit = "x"

    def track_lru_resume_vs_resident(self, rows):
        return rows["lru"]["ttft_p50"] / rows["resident"]["ttft_p50"]

    track_lru_resume_vs_resident.unit = "x"

    def track_recomputes_lifecycle(self, rows):
        return rows["lifecycle"]["recomputes"]

    track_recomputes_lifecycle.unit = "blocks"

    def track_recomputes_lru(self, rows):
        return rows["lru"]["recomputes"]

    track_recomputes_lru.unit = "blocks"

    def track_ended_bytes_left(self, rows):
        return rows["lifecycle"]["ended_bytes_left"]

    track_ended_bytes_left.unit = "bytes"
