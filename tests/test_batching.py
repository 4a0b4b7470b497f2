"""Batched siblings and the local prefix cache: same tokens as the unbatched / replay paths."""

from __future__ import annotations

import dask
import pytest

import dask_kvstate as kvs
from dask_kvstate.backends.batch import Row, generate_batch
from dask_kvstate.generation import Sampling
from dask_kvstate.plugins.worker.runtime import common_prefix

from .conftest import CONTEXT, compute_released, on, stats_of

# Suffixes of different token lengths, so rows need left padding.
SUFFIXES = [f"Question {i}: {'why ' * (i % 5)}is the plan late?" for i in range(6)]


def rows_for(backend, suffixes, seed=None):
    """Rows over the prefill of CONTEXT, and that prefill's KV (the shared prefix)."""
    prefix = backend.tokenize(CONTEXT)
    kv = backend.kv_from_cache(backend.prefill(prefix)[0])
    rows = []
    for s in suffixes:
        ids = backend.tokenize(CONTEXT + s)
        rows.append(Row(ids, min(common_prefix(prefix, ids), len(ids) - 1), seed))
    return rows, kv


def stock(backend, row, kv, **params):
    """The same generation through transformers' own cache (DynamicCache, sdpa): the reference."""
    return backend.generate_in_cache(row.ids, kv[:, :, :, : row.keep], Sampling(seed=row.seed, **params)).token_ids


def test_batched_decode_equals_unbatched_token_for_token(backend):
    rows, kv = rows_for(backend, SUFFIXES)
    assert len({len(r.ids) for r in rows}) > 1, "the suffixes should differ in length"
    single = [stock(backend, r, kv, max_new_tokens=20) for r in rows]
    batched = generate_batch(backend, rows, kv, Sampling(max_new_tokens=20))
    assert [b.token_ids for b in batched] == single
    assert all(len(t) == 20 for t in single)


def test_batched_sampling_with_seeds_equals_unbatched(backend):
    rows, kv = rows_for(backend, SUFFIXES[:3], seed=7)
    single = [stock(backend, r, kv, max_new_tokens=12, temperature=0.9) for r in rows]
    batched = generate_batch(backend, rows, kv, Sampling(max_new_tokens=12, temperature=0.9))
    assert [b.token_ids for b in batched] == single


def test_rows_that_stop_early_leave_the_batch(backend):
    rows, kv = rows_for(backend, SUFFIXES[:4])
    full = [stock(backend, r, kv, max_new_tokens=10) for r in rows]
    # Make one row's 3rd token an end token: that row stops there, the others go on.
    eos = backend.eos_ids
    try:
        backend.eos_ids = frozenset({full[1][2]})
        batched = generate_batch(backend, rows, kv, Sampling(max_new_tokens=10))
        single = [stock(backend, r, kv, max_new_tokens=10) for r in rows]
    finally:
        backend.eos_ids = eos
    assert [b.token_ids for b in batched] == single
    assert len(batched[1].token_ids) <= 3


def test_resume_many_equals_resume_on_the_cluster(client, workers):
    with on(workers[0]):
        state = kvs.materialize(CONTEXT, namespace="batching")
        batch = kvs.resume_many(state, SUFFIXES, max_new_tokens=12)
        single = [kvs.resume(state, s, max_new_tokens=12) for s in SUFFIXES]
    before = stats_of(client, workers[0]).get("resume_batches", 0)
    got_batch, got_single = dask.compute(batch, single)
    assert [g.token_ids for g in got_batch] == [g.token_ids for g in got_single]
    assert all(g.reused_tokens > 0 for g in got_batch)
    assert stats_of(client, workers[0]).get("resume_batches", 0) == before + 1


def test_compiler_batches_siblings_and_keeps_keys(client):
    prompts = [kvs.generate(CONTEXT, s, max_new_tokens=10) for s in SUFFIXES]
    replay = compute_released(*prompts)
    with dask.config.set({"kvstate.compiler.batch-siblings": 4}):
        graph = dict(kvs.optimize(dask.delayed(list)(prompts).__dask_graph__(), [p.key for p in prompts]))
        batches = [k for k in graph if str(k).startswith("kvs-resume_many-")]
        assert len(batches) == 2  # six siblings, at most four a batch: 3 + 3
        assert all(p.key in graph for p in prompts)
        before = sum(s.get("batched_resumes", 0) for s in kvs.stats(client).workers.values())
        with kvs.stateflow():
            compiled = dask.compute(*[kvs.generate(CONTEXT, s, max_new_tokens=10) for s in SUFFIXES])
    assert [c.token_ids for c in compiled] == [r.token_ids for r in replay]
    assert sum(s.get("batched_resumes", 0) for s in kvs.stats(client).workers.values()) == before + len(SUFFIXES)


def test_batching_off_leaves_plain_resumes():
    prompts = [kvs.generate(CONTEXT, s, max_new_tokens=4) for s in SUFFIXES[:3]]
    with dask.config.set({"kvstate.compiler.batch-siblings": 1}):
        graph = dict(kvs.optimize(dask.delayed(list)(prompts).__dask_graph__(), [p.key for p in prompts]))
    assert not [k for k in graph if str(k).startswith("kvs-resume_many-")]


def test_resume_many_rejects_an_empty_list():
    with pytest.raises(ValueError, match="at least one suffix"):
        kvs.resume_many(kvs.materialize(CONTEXT), [])


def test_local_prefix_cache_reuses_blocks_on_its_worker_only(client, workers):
    text = "Prefix cache check. " + CONTEXT
    with on(workers[0]):
        replay = kvs.generate(text, "First question?", max_new_tokens=8)
        first = kvs.generate(text, "First question?", max_new_tokens=8, prefix_cache=True)
    with on(workers[0]):
        second = kvs.generate(text, "Second question?", max_new_tokens=8, prefix_cache=True)
    with on(workers[1]):
        # Another suffix: equal calls share one key, and so one task, wherever annotated.
        elsewhere = kvs.generate(text, "Third question?", max_new_tokens=8, prefix_cache=True)
        elsewhere_replay = kvs.generate(text, "Third question?", max_new_tokens=8)
    second_replay = kvs.generate(text, "Second question?", max_new_tokens=8)
    r, f = dask.compute(replay, first)
    s, e, er, sr = dask.compute(second, elsewhere, elsewhere_replay, second_replay)
    assert f.token_ids == r.token_ids and f.reused_tokens == 0
    assert s.reused_tokens > 0 and s.prefill_tokens < s.prompt_tokens  # hits on its own worker
    assert e.reused_tokens == 0  # no transfer between workers
    assert s.token_ids == sr.token_ids and e.token_ids == er.token_ids
    assert stats_of(client, workers[0]).get("prefix_cache_hits", 0) > 0


@pytest.mark.slow
def test_smollm2_batched_siblings_equal_unbatched_on_the_bench_prompts():
    """16 agents of the bench's workload on SmolLM2, 1,024-token context: batched == unbatched."""
    from dask_kvstate.backends import load_backend
    from dask_kvstate.bench import workload

    smol = load_backend("smollm2-135m")
    lines = 1
    while len(smol.tokenize(workload.context_text(lines * 2))) <= 1024:
        lines *= 2
    context = workload.context_text(lines)
    prefix = smol.tokenize(context)
    kv = smol.kv_from_cache(smol.prefill(prefix)[0])
    rows = []
    for i in range(16):
        ids = smol.tokenize(context + workload.suffix(i))
        rows.append(Row(ids, min(common_prefix(prefix, ids), len(ids) - 1)))
    single = [stock(smol, r, kv, max_new_tokens=32) for r in rows]
    batched = [r.token_ids for r in generate_batch(smol, rows, kv, Sampling(max_new_tokens=32))]
    assert batched == single
