"""The real default model, SmolLM2-135M, end to end on two worker processes (slow: run once)."""

from __future__ import annotations

import dask
import pytest
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.bench.tree_of_thought import QUESTIONS, prompt_parts

from .conftest import on

pytestmark = pytest.mark.slow


def test_smollm2_reuse_across_workers_is_token_identical_to_text_replay():
    parts = [prompt_parts(12, q) for q in QUESTIONS[:3]]
    prefix = parts[0][0]
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            kvs.install(client, "smollm2-135m", torch_threads=1)
            a, b = sorted(client.nthreads())
            with on(a):
                state = kvs.materialize(prefix)
            branches = kvs.fork(state, 3)
            with on(b):  # every branch runs away from the holder: a real pull of real KV
                reused = [kvs.resume(r, s, max_new_tokens=16) for r, (_, s) in zip(branches, parts)]
            replay = [kvs.generate(p, s, max_new_tokens=16) for p, s in parts]
            ref, got, want = dask.compute(state, reused, replay)
            stats = kvs.stats(client).workers
    assert ref.num_tokens > 300 and ref.model_name == "smollm2-135m"
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.reused_tokens >= ref.num_tokens - 1
    assert stats[b]["transfer_bytes"] == ref.nbytes
    assert "TIMEOUT" in prefix and any(len(g.strip()) > 0 for g in got)
