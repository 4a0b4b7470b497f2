"""The operators on a real two-process cluster with tiny-llama, each checked against text replay."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import dask
import pytest
from distributed import Client, LocalCluster

import dask_kvstate as kvs

from .conftest import CONTEXT, TEST_CONFIG, on, stats_of

QUESTIONS = ["Question: who writes the code?", " Who runs the tests?", "\nWhat fails?", " and then the planner"]


def replay(client, *segments, n=16):
    return client.compute(kvs.generate(*segments, max_new_tokens=n)).result()


def test_generate_returns_text_with_token_ids(client):
    out = replay(client, CONTEXT, QUESTIONS[0])
    assert isinstance(out, str) and isinstance(out, kvs.Generation)
    assert 0 < len(out.token_ids) <= 16 and out.reused_tokens == 0 and out.ttft > 0


def test_resume_is_token_identical_to_text_replay(client):
    state = kvs.materialize(CONTEXT)
    outs = dask.compute(*[kvs.resume(state, q, max_new_tokens=16) for q in QUESTIONS])
    for q, out in zip(QUESTIONS, outs):
        assert out.token_ids == replay(client, CONTEXT, q).token_ids
        assert out.reused_tokens > 0


def test_materialize_on_a_resume_on_b_pulls_the_blocks(client, workers):
    a, b = workers
    text = "Transfer test. " + CONTEXT
    before = stats_of(client, b)
    with on(a):
        state = kvs.materialize(text)
    with on(b):
        out = kvs.resume(state, QUESTIONS[1], max_new_tokens=16)
    ref, got = dask.compute(state, out)
    after = stats_of(client, b)
    assert ref.placement.worker == a
    assert got.token_ids == replay(client, text, QUESTIONS[1]).token_ids
    assert after["transfers"] - before.get("transfers", 0) == len(ref.blocks)
    assert after["transfer_bytes"] - before.get("transfer_bytes", 0) == ref.nbytes
    assert after.get("recomputes", 0) == before.get("recomputes", 0)


def test_fork_shares_blocks_and_each_branch_matches_replay(client, workers):
    a, _ = workers
    text = "Fork test. " + CONTEXT
    before = stats_of(client, a)
    with on(a):
        state = kvs.materialize(text)
        children = kvs.fork(state, 4)
        extended = [kvs.extend(c, q) for c, q in zip(children, QUESTIONS)]
        outs = [kvs.resume(e, " Answer:", max_new_tokens=12) for e in extended]
    futures = client.compute([state, *children, *extended, *outs])
    results = client.gather(futures)
    ref, kids, exts, gens = results[0], results[1:5], results[5:9], results[9:]
    after = stats_of(client, a)

    assert {k.blocks for k in kids} == {ref.blocks} and len({k.state_id for k in kids}) == 4
    assert all(k.lineage.op == "fork" and k.lineage.parents == (ref.state_id,) for k in kids)
    unique = set(ref.blocks).union(*(e.blocks for e in exts))
    # Prefix blocks stored once: the store grew by exactly the distinct blocks.
    assert after["blocks"] - before["blocks"] == len(unique)
    assert after["bytes"] - before["bytes"] < sum(e.nbytes for e in exts)
    full_prefix = ref.blocks[: ref.num_tokens // ref.block_tokens]
    assert all(e.blocks[: len(full_prefix)] == full_prefix for e in exts)
    for q, g in zip(QUESTIONS, gens):
        assert g.token_ids == replay(client, text, q, " Answer:", n=12).token_ids
    del futures


def test_extend_chain_equals_prefill_of_the_whole_text(client):
    parts = [CONTEXT, "Round 1: the planner", " speaks", "; round 2: the tester answers."]
    state = kvs.materialize(parts[0])
    for p in parts[1:]:
        state = kvs.extend(state, p)
    direct = kvs.materialize("".join(parts))
    chained, fresh = dask.compute(state, direct)
    assert chained.blocks == fresh.blocks and chained.num_tokens == fresh.num_tokens
    assert chained.lineage.op == "extend"
    out = client.compute(kvs.resume(state, " Verdict:", max_new_tokens=12)).result()
    assert out.token_ids == replay(client, *parts, " Verdict:", n=12).token_ids


def test_extend_mid_word_boundary_recrops_to_the_common_token_prefix(client):
    # "plan" + "ner" tokenizes differently from "planner": the state's last token is
    # not a prefix token of the joined text, and the runtime must notice.
    state = kvs.extend(kvs.materialize(CONTEXT + "The plan"), "ner speaks")
    whole = kvs.materialize(CONTEXT + "The planner speaks")
    a, b = dask.compute(state, whole)
    assert a.blocks == b.blocks
    out = client.compute(kvs.resume(kvs.materialize(CONTEXT + "The plan"), "ner", max_new_tokens=12)).result()
    assert out.token_ids == replay(client, CONTEXT, "The planner", n=12).token_ids


def test_valid_merge_equals_prefill_of_the_concatenation(client):
    first = kvs.materialize(CONTEXT)
    second = kvs.extend(first, "Then the tester reports.")
    merged = kvs.merge(first, second)
    m, s, direct = dask.compute(merged, second, kvs.materialize(CONTEXT + "Then the tester reports."))
    assert m.blocks == s.blocks == direct.blocks
    assert m.lineage.op == "merge" and set(m.lineage.parents) == {s.lineage.parents[0], s.state_id}
    out = client.compute(kvs.resume(merged, " Next:", max_new_tokens=12)).result()
    assert out.token_ids == replay(client, CONTEXT, "Then the tester reports.", " Next:", n=12).token_ids


def test_invalid_merges_raise_clear_errors(client):
    root = kvs.materialize(CONTEXT)
    left, right = kvs.extend(root, " Left branch."), kvs.extend(root, " Right branch.")
    with pytest.raises(kvs.MergeError, match="diverge at character"):
        dask.compute(kvs.merge(left, right))
    with pytest.raises(kvs.MergeError, match="independently prefilled segments"):
        dask.compute(kvs.merge(kvs.materialize("Segment one."), kvs.materialize("Segment two.")))
    with pytest.raises(ValueError, match="unknown merge policy 'blend'"):
        kvs.merge(left, right, policy="blend")


def test_state_of_another_config_is_never_reused(client):
    ref = client.compute(kvs.materialize(CONTEXT)).result()
    alien = replace(ref, config="c-from-another-model")
    before = sum(s.get("incompatible", 0) for s in kvs.stats(client).workers.values())
    out = client.compute(kvs.resume(alien, QUESTIONS[2], max_new_tokens=16)).result()
    after = sum(s.get("incompatible", 0) for s in kvs.stats(client).workers.values())
    assert after == before + 1 and out.reused_tokens == 0
    assert out.token_ids == replay(client, CONTEXT, QUESTIONS[2]).token_ids


def test_state_of_another_model_is_recomputed_with_the_same_output(client, other_model):
    with dask.config.set(TEST_CONFIG):
        with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as c2, Client(c2) as other_client:
            kvs.install(other_client, other_model, torch_threads=1)
            foreign = other_client.compute(kvs.materialize(CONTEXT)).result()
    assert foreign.model != client.compute(kvs.materialize(CONTEXT)).result().model
    out = client.compute(kvs.resume(foreign, QUESTIONS[0], max_new_tokens=16)).result()
    assert out.reused_tokens == 0
    assert out.token_ids == replay(client, CONTEXT, QUESTIONS[0]).token_ids


def test_two_models_on_one_cluster_never_share_state(other_model):
    with dask.config.set(TEST_CONFIG):
        with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as c2, Client(c2) as c:
            kvs.install(c, ["tiny-llama", other_model], torch_threads=1)
            a = kvs.materialize(CONTEXT)  # the default model: tiny-llama
            b = kvs.materialize(CONTEXT, model=other_model)
            ra, rb = dask.compute(a, b)
            assert ra.model != rb.model and set(ra.blocks).isdisjoint(rb.blocks)
            own = dask.compute(
                kvs.resume(a, QUESTIONS[1], max_new_tokens=12), kvs.resume(b, QUESTIONS[1], max_new_tokens=12)
            )
            crossed = c.compute(kvs.resume(a, QUESTIONS[1], max_new_tokens=12, model=other_model)).result()
            want = dask.compute(
                kvs.generate(CONTEXT, QUESTIONS[1], max_new_tokens=12),
                kvs.generate(CONTEXT, QUESTIONS[1], max_new_tokens=12, model=other_model),
            )
            with pytest.raises(ValueError, match="model 'gpt-x' is not installed"):
                c.compute(kvs.generate("x", model="gpt-x")).result()
    assert [o.token_ids for o in own] == [w.token_ids for w in want]
    assert own[0].reused_tokens > 0 and own[1].reused_tokens > 0
    assert crossed.reused_tokens == 0 and crossed.token_ids == want[1].token_ids  # recomputed, never reused


def test_evict_frees_the_bytes(client, workers):
    a, _ = workers
    with on(a):
        state = kvs.materialize("Evict me. " + CONTEXT).persist()
    ref = state.compute()
    held = stats_of(client, a)
    assert held["pinned_bytes"] >= ref.nbytes
    freed = kvs.evict(state).compute()
    after = stats_of(client, a)
    assert freed == ref.nbytes
    assert held["bytes"] - after["bytes"] == ref.nbytes
    # The ref still works after eviction: its blocks are recomputed from its text.
    out = client.compute(kvs.resume(state, QUESTIONS[0], max_new_tokens=8)).result()
    assert out.token_ids == replay(client, "Evict me. " + CONTEXT, QUESTIONS[0], n=8).token_ids


def test_transfer_moves_the_state_to_the_named_worker(client, workers):
    a, b = workers
    with on(a):
        state = kvs.materialize("Move me. " + CONTEXT)
    moved = kvs.transfer(state, b)
    ref, m = dask.compute(state, moved)
    assert (ref.placement.worker, m.placement.worker) == (a, b)
    assert m.blocks == ref.blocks and m.lineage.op == "transfer"


def test_futures_api_with_client_submit(client):
    ref = client.submit(kvs.tasks.materialize, CONTEXT, pure=False)
    out = client.submit(kvs.tasks.resume, ref, QUESTIONS[3], max_new_tokens=16)
    assert out.result().token_ids == replay(client, CONTEXT, QUESTIONS[3]).token_ids


def _set_config(key: str, value):
    """Set ``key`` in this process's config (run on a worker); returns the value it had."""
    old = dask.config.get(key)
    dask.config.set({key: value})
    return old


@contextlib.contextmanager
def worker_config(client, key: str, value):
    """``key`` set to ``value`` in every worker process (never on this client) while inside."""
    old = client.run(_set_config, key, value)
    try:
        yield
    finally:
        for worker, was in old.items():
            client.run(_set_config, key, was, workers=[worker])


def generations_run(client) -> int:
    return sum(s.get("generations", 0) for s in kvs.stats(client).workers.values())


def test_unseeded_sampling_set_on_the_client_is_never_deduplicated(client):
    # The temperature is the client's only: the workers keep greedy decoding in their config.
    with dask.config.set({"kvstate.generate.temperature": 0.8}):
        pair = [kvs.generate(CONTEXT, QUESTIONS[0], max_new_tokens=8) for _ in range(2)]
        seeded = kvs.generate(CONTEXT, QUESTIONS[0], max_new_tokens=8, seed=7)
    assert pair[0].key != pair[1].key
    # The seeded call's key is that of an explicit temperature: fixed when built.
    assert seeded.key == kvs.generate(CONTEXT, QUESTIONS[0], max_new_tokens=8, temperature=0.8, seed=7).key
    before = generations_run(client)
    outs = dask.compute(*pair)
    assert generations_run(client) - before == 2  # two samples drawn, not one result handed out twice
    assert all(len(o.token_ids) <= 8 for o in outs)
    # What the workers ran is the client's temperature: the same draw as a task given it
    # explicitly, and not the greedy decode their own config would give.
    got = client.compute(seeded).result()
    explicit = client.submit(
        kvs.tasks.generate, CONTEXT, QUESTIONS[0], max_new_tokens=8, temperature=0.8, seed=7, pure=False
    ).result()
    assert got.token_ids == explicit.token_ids
    assert got.token_ids != replay(client, CONTEXT, QUESTIONS[0], n=8).token_ids


def test_equal_greedy_calls_share_one_key_and_one_generation(client):
    pair = [kvs.generate(CONTEXT, QUESTIONS[1], max_new_tokens=8) for _ in range(2)]
    assert pair[0].key == pair[1].key
    before = generations_run(client)
    a, b = dask.compute(*pair)
    assert generations_run(client) - before == 1 and a.token_ids == b.token_ids


def test_a_built_graph_runs_the_clients_settings_whatever_the_workers_config(client):
    text = "Settings test. " + CONTEXT
    with dask.config.set({"kvstate.generate.max-new-tokens": 6, "kvstate.generate.prefix-cache": True}):
        cached = kvs.generate(text, QUESTIONS[2])
        shared = [kvs.generate(text, q) for q in QUESTIONS[:2]]  # the compiler rewrites these into resumes
    assert cached.dask[cached.key].kwargs["prefix_cache"] is True
    before = kvs.stats(client).workers
    with worker_config(client, "kvstate.generate.max-new-tokens", 2):
        got = client.compute(cached).result()
        with kvs.stateflow():
            compiled = dask.compute(*shared)
        # A task built without settings (a plain submit) is the one that takes the worker's.
        plain = client.submit(kvs.tasks.generate, text, QUESTIONS[2], pure=False).result()
    after = kvs.stats(client).workers
    looked_up = sum(
        after[w].get(c, 0) - before[w].get(c, 0) for w in after for c in ("prefix_cache_hits", "prefix_cache_misses")
    )
    assert looked_up > 0  # the client's prefix-cache choice, where the workers' config says no
    want = replay(client, text, QUESTIONS[2], n=6).token_ids
    assert len(want) == 6 and got.token_ids == want
    assert plain.token_ids == want[:2]
    for q, out in zip(QUESTIONS, compiled):
        assert out.reused_tokens > 0 and out.token_ids == replay(client, text, q, n=6).token_ids


def test_bad_inputs_name_what_is_wrong(client):
    with pytest.raises(TypeError, match="prompt segment 1 is a int"):
        client.compute(kvs.materialize("a", 3)).result()
    with pytest.raises(TypeError, match="must be a KVStateRef"):
        client.compute(kvs.resume("not a state", "x")).result()
    with pytest.raises(ValueError, match="max_new_tokens"):
        client.compute(kvs.generate("x", max_new_tokens=-1)).result()
    with pytest.raises(ValueError, match="empty prompt"):
        client.compute(kvs.materialize("")).result()
    with pytest.raises(ValueError, match="positive int k"):
        kvs.fork(kvs.materialize("x"), 0)
    with pytest.raises(RuntimeError, match="inside Dask tasks"):
        kvs.tasks.materialize("no worker here")


def test_install_is_idempotent_and_rejects_unknown_models(client):
    first = kvs.install(client, "tiny-llama", torch_threads=1)
    assert kvs.install(client, "tiny-llama", torch_threads=1) == first
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        kvs.install(client, "nope")
    assert all(s["installed"] and s["model"] == "tiny-llama" for s in kvs.stats(client).workers.values())
    with pytest.raises(ValueError, match=r"unknown extension\(s\) \['nope'\]"):
        kvs.install(client, scheduling={"nope": True})  # checked before anything reaches the cluster
    with pytest.raises(ValueError, match="model=False installs no block store"):
        kvs.install(client, model=False, lifecycle=True)


def test_the_deprecated_aliases_warn_and_still_work(client):
    from dask_kvstate.plugins.scheduler.sessions import SessionTracker

    full = kvs.stats(client)
    with pytest.warns(FutureWarning, match=r"kvs\.stats\(client\)\.placement"):
        assert kvs.placement_stats(client)["installed"] is full.placement["installed"] is True
    with pytest.warns(FutureWarning, match=r"kvs\.stats\(client\)\.scheduling"):
        assert set(kvs.scheduling_stats(client)) == set(full.scheduling)
    with pytest.warns(FutureWarning, match=r"kvs\.stats\(client\)\.lifecycle"):
        assert kvs.lifecycle_stats(client)["installed"] is full.lifecycle["installed"] is True  # on by default
    with pytest.warns(FutureWarning, match=r"kvs\.install\(client, model=False\)"):
        assert kvs.install_scheduling(client)[0] == SessionTracker.name  # already there: a no-op
    with pytest.warns(FutureWarning, match=r"kvs\.stats\(client\)\.workers"):
        assert sorted(full) == sorted(full.workers)
