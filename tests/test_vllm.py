"""The vLLM backend on SmolLM2: its connector's KV layout, every reuse path against the same
engine's text replay, and that replay against transformers' own ``generate``.

Skips, saying why, where vLLM is not installed (the ``vllm`` extra).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import dask
import pytest
import torch
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.bench import workload
from dask_kvstate.generation import Sampling
from dask_kvstate.plugins.worker.runtime import common_prefix

from .conftest import SPAWNED, VLLM_TESTS, compute_released, on, transformers_continuation, vllm_prompts

pytestmark = VLLM_TESTS

PARTS = vllm_prompts()
PREFIX = PARTS[0][0]
GREEDY = Sampling(max_new_tokens=8, temperature=0.0, top_p=1.0, seed=None)
#: The engine users get by default: the two workers' engines below compile (the in-process
#: engine, and the rest of the suite, run eager, to start sooner).
COMPILED = {"kvstate.vllm.compile": True}


@pytest.fixture(scope="module")
def backend():
    from dask_kvstate.backends import load_backend

    with dask.config.set({"kvstate.backend": "vllm", "kvstate.block-tokens": 64}):
        b = load_backend("smollm2-135m")
    yield b
    b.close()


@pytest.fixture(scope="module")
def hf_model():
    from dask_kvstate.backends import models

    model, tokenizer = models.load("smollm2-135m", dtype="float32")
    return model


def test_backend_conformance_of_the_vllm_backend(backend):
    from dask_kvstate.testing.conformance import check_backend_conformance

    with dask.config.set({"kvstate.block-tokens": backend.block_tokens}):  # a state's blocks are the engine's
        check_backend_conformance(backend)  # not closed: the module's other tests use this engine


def test_the_engine_gets_exactly_the_kv_memory_configured(backend):
    """``kvstate.vllm.kv-cache-bytes`` reaches vLLM in bytes, not rounded to whole GiB."""
    from dask_kvstate import config

    cache = backend.loop.engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == config.get_bytes("vllm.kv-cache-bytes")
    # and the engine sized its pages from it: never more blocks than those bytes hold
    page = backend.kv_bytes_per_token * backend.block_tokens
    assert 0 < cache.num_gpu_blocks <= cache.kv_cache_memory_bytes // page


def test_a_model_whose_layers_agree_on_their_window_keeps_its_attention_split(backend):
    """Only engines mixing windows plan without KV splits (tests/test_vllm_kit.py's Gemma 3)."""
    from dask_kvstate.backends.vllm_start import plan_mixed_windows_unsplit

    assert plan_mixed_windows_unsplit(backend.loop.engine) is False


def test_captured_kv_is_transformers_kv_of_the_same_prompt(backend, hf_model):
    ids = backend.tokenize(PREFIX)
    kv = backend.kv_from_cache(backend.prefill(ids)[0])
    with torch.inference_mode():
        cache = hf_model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    want = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])
    assert kv.shape == want.shape == (backend.num_layers, 2, backend.kv_heads, len(ids), backend.head_dim)
    # Same math, other kernels: equal to rounding, and the keys in token order (a layout
    # slip would put whole rows of other tokens here).
    assert torch.allclose(kv, want, atol=1e-3, rtol=1e-3), (kv - want).abs().max()


def test_a_loaded_state_resumes_token_identical_to_replay(backend):
    ids = backend.tokenize(PREFIX)
    kv = backend.kv_from_cache(backend.prefill(ids)[0])
    for _, suffix in PARTS:
        full = backend.tokenize(PREFIX + suffix)
        assert full[: len(ids) - 1] == ids[: len(ids) - 1]
        backend.reset_engine_cache()
        replay = backend.generate(full, None, GREEDY)
        backend.reset_engine_cache()  # nothing left in the engine: the state's blocks must be loaded
        before = backend.counters["loaded_tokens"]
        resumed = backend.generate(full, kv[:, :, :, : len(ids) - 1], GREEDY)
        loaded = backend.counters["loaded_tokens"] - before
        assert loaded == len(ids) - 1  # all of it, the last part-filled block too
        assert resumed.token_ids == replay.token_ids
        assert resumed.prefill_tokens == len(full) - loaded


def _layouts(kv: torch.Tensor, tokens: int) -> dict:
    """The KV of ``kv``'s first ``tokens`` tokens as every form a resume hands the connector."""
    from dask_kvstate.blocks import BlockKV
    from dask_kvstate.plugins.worker.arena import lay_out

    head = kv[:, :, :, :tokens]
    return {
        "joined tensor": head,
        "blocks of a joined tensor": BlockKV.split(head, 64),
        "block arena (a pulled frame)": BlockKV(tuple(lay_out(head, 64))),
        "blocks apart": BlockKV(tuple(b.clone() for b in BlockKV.split(head, 64).blocks)),
    }


def test_write_blocks_puts_every_layout_in_the_engines_pages():
    """Engine-free: the paged layout written from each source form reads back as the source,
    on scattered paged blocks (index copies) and on consecutive ones (slice copies), and a
    capture of those blocks is the source again."""
    from dask_kvstate.backends.vllm_pages import capture_blocks, load_chunks, write_blocks
    from dask_kvstate.blocks import BlockKV

    layers, heads, dim, size = 3, 2, 8, 64
    kv = torch.randn(layers, 2, heads, 200, dim)
    for name, layout in _layouts(kv, 150).items():  # 2 whole blocks and a partial one
        load = layout if isinstance(layout, BlockKV) else BlockKV.split(layout, size)  # as the backend hands it on
        for index in ([4, 1, 3], [2, 3, 4]):
            pages = [torch.full((6, heads, size, 2 * dim), 7.0) for _ in range(layers)]
            write_blocks(pages, index, load_chunks(load, 0, 150, size))
            assert torch.equal(capture_blocks(pages, index, 150), kv[:, :, :, :150]), (name, index)
            untouched = sorted(set(range(6)) - set(index))
            assert all(torch.all(p[untouched] == 7.0) for p in pages), (name, index)  # no other block touched
            for tokens in (150, 128, 20):  # a partial last block, whole blocks only, inside the first block
                assert torch.equal(capture_blocks(pages, index, tokens), kv[:, :, :, :tokens]), (name, index, tokens)
        chunks = load_chunks(load, 64, 130, size)  # from a block boundary (an engine hit) to mid-block
        assert [c.shape[3] for c in chunks] == [64, 2]
        assert torch.equal(torch.cat(chunks, dim=3), kv[:, :, :, 64:130]), name


def test_a_prefill_over_a_past_copies_out_only_the_kv_from_keep_from(backend):
    """An extend stores only its new blocks: the engine copies out the KV from the block
    holding ``keep_from`` on, and that is the whole prefill's KV of those tokens."""
    ids = backend.tokenize(PREFIX + PARTS[0][1])
    size = backend.block_tokens
    assert len(ids) > 2 * size + 1
    backend.reset_engine_cache()
    whole = backend.kv_from_cache(backend.prefill(ids)[0])
    for keep_from in (2 * size, 2 * size + 5):  # on a block boundary, and inside a block
        backend.reset_engine_cache()  # the tail is computed over the loaded past, not found in the engine
        tail = backend.kv_from_cache(backend.prefill(ids, whole[:, :, :, : 2 * size + 7], keep_from=keep_from)[0])
        assert tail.shape[3] == len(ids) - 2 * size, keep_from
        torch.testing.assert_close(tail, whole[:, :, :, 2 * size :], atol=1e-4, rtol=1e-4)


def test_a_generation_hands_its_prompt_kv_from_keep_from_on_and_decodes_as_replay(backend):
    """The local prefix cache asks only for the blocks its store lacks: ``on_prefill`` gets
    the KV from ``keep_from``'s block on, equal to the whole prompt's there, and the tokens
    are those of a generation that hands nothing out."""
    ids = backend.tokenize(PREFIX + PARTS[0][1])
    size = backend.block_tokens
    sampling = Sampling(max_new_tokens=6)
    backend.reset_engine_cache()
    whole = backend.kv_from_cache(backend.prefill(ids)[0])
    backend.reset_engine_cache()
    want = backend.generate(ids, None, sampling).token_ids
    for keep_from in (0, 2 * size, 2 * size + 5):
        backend.reset_engine_cache()
        handed: list = []
        got = backend.generate(ids, whole[:, :, :, : 2 * size], sampling, on_prefill=handed.append, keep_from=keep_from)
        assert got.token_ids == want, keep_from
        (kv,) = [backend.kv_from_cache(c) for c in handed]
        first = keep_from // size * size
        assert kv.shape[3] == len(ids) - first, keep_from
        torch.testing.assert_close(kv, whole[:, :, :, first:], atol=1e-4, rtol=1e-4)


def test_a_generation_hands_its_prompt_and_answer_kv_and_decodes_as_replay(backend):
    """``on_sequence``: once the request has finished, the KV of the prompt and of every
    generated token but the last (no forward computed the last one's), from
    ``keep_from``'s block on, with those tokens' ids; equal to a prefill of the same ids,
    and the tokens those of a generation that hands nothing out."""
    ids = backend.tokenize(PREFIX + PARTS[0][1])
    size = backend.block_tokens
    sampling = Sampling(max_new_tokens=12)
    backend.reset_engine_cache()
    want = backend.generate(ids, None, sampling).token_ids
    for keep_from in (0, 2 * size + 5):
        backend.reset_engine_cache()
        handed: list = []
        got = backend.generate(ids, None, sampling, on_sequence=lambda c, s: handed.append((c, s)), keep_from=keep_from)
        assert got.token_ids == want, keep_from
        ((cache, seq),) = handed
        assert seq == ids + want[:-1]
        kv = backend.kv_from_cache(cache)
        first = keep_from // size * size
        assert kv.shape[3] == len(seq) - first, keep_from
        backend.reset_engine_cache()
        whole = backend.kv_from_cache(backend.prefill(seq)[0])
        torch.testing.assert_close(kv, whole[:, :, :, first:], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not both"):
        backend.generate(ids, None, sampling, on_prefill=print, on_sequence=print)


def test_every_form_of_a_loaded_state_resumes_token_identical(backend):
    ids = backend.tokenize(PREFIX)
    kv = backend.kv_from_cache(backend.prefill(ids)[0])
    _, suffix = PARTS[1]
    full = backend.tokenize(PREFIX + suffix)
    backend.reset_engine_cache()
    replay = backend.generate(full, None, GREEDY)
    for name, load in _layouts(kv, len(ids) - 1).items():
        backend.reset_engine_cache()
        before = backend.counters["loaded_tokens"]
        resumed = backend.generate(full, load, GREEDY)
        assert backend.counters["loaded_tokens"] - before == len(ids) - 1, name
        assert resumed.token_ids == replay.token_ids, name


def test_replay_equals_transformers_generate(backend, hf_model):
    for prefix, suffix in PARTS:
        ids = backend.tokenize(prefix + suffix)
        got = backend.generate(ids, None, GREEDY).token_ids
        assert got == transformers_continuation(hf_model, ids, 8)[: len(got)]


def test_requests_that_do_not_read_the_engine_cache_compute_every_token_and_agree(backend):
    """``kvstate.vllm.read-prefix-cache: false`` is vLLM with prefix caching off (the bench's
    text replay): the prompt is computed again and the tokens are the same; a resume still
    loads its state (vLLM asks no connector for a request that skips its cache)."""
    from dask_kvstate.backends.batch import Row

    ids = backend.tokenize(PREFIX + PARTS[1][1])
    backend.reset_engine_cache()
    cached = backend.generate(ids, None, GREEDY)
    warm = backend.generate(ids, None, GREEDY)
    assert warm.prefill_tokens < len(ids)  # the engine's own cache served the prompt
    prefix_ids = backend.tokenize(PREFIX)
    keep = len(prefix_ids) - 1
    rows = [Row(ids=backend.tokenize(PREFIX + suffix), keep=keep) for _, suffix in PARTS]
    with dask.config.set({"kvstate.vllm.read-prefix-cache": False}):
        replay = backend.generate(ids, None, GREEDY)
        kv = backend.kv_from_cache(backend.prefill(prefix_ids)[0])
        backend.reset_engine_cache()
        before = backend.counters["loaded_tokens"]
        batched = backend.generate_batch(rows, kv[:, :, :, :keep], GREEDY, started=0.0)
        loaded = backend.counters["loaded_tokens"] - before
        replays = [backend.generate(row.ids, None, GREEDY) for row in rows]
    assert replay.prefill_tokens == len(ids) and replay.token_ids == cached.token_ids == warm.token_ids
    # the first row loaded the whole state; its siblings found its whole blocks in the engine
    assert keep <= loaded < len(rows) * keep
    assert all(r.prefill_tokens == len(row.ids) for r, row in zip(replays, rows))
    assert [g.token_ids for g in batched] == [r.token_ids for r in replays]


def test_an_engine_sharing_its_cores_with_a_stepping_peer_gives_the_same_tokens(backend):
    """Another engine of this host given the same cores steps: ours runs on its share, same output."""
    from dask_kvstate.testing import core_peer

    board = backend.loop._cores
    if board is None or board.cores < 2:
        pytest.skip("the engine has one core: there is nothing to share")
    ids = backend.tokenize(PREFIX + PARTS[1][1])
    backend.reset_engine_cache()
    alone = backend.generate(ids, None, GREEDY)
    peer = core_peer.start(board.spec, board.path.parent, "stepping")  # another engine's claim
    try:
        before = backend.exchange.counters["steps_on_shared_cores"]
        backend.reset_engine_cache()
        shared = backend.generate(ids, None, GREEDY)
        assert backend.exchange.counters["steps_on_shared_cores"] > before
    finally:
        core_peer.stop(peer)
    assert shared.token_ids == alone.token_ids
    backend.reset_engine_cache()
    again = backend.generate(ids, None, GREEDY)  # alone again: the driver takes every core back
    assert again.token_ids == alone.token_ids
    assert backend.loop.call(lambda engine: torch.get_num_threads()) == board.cores
    # ... on its own thread only: a thread starting now runs torch on one, not beside the engine's team
    with ThreadPoolExecutor(1) as fresh:
        assert fresh.submit(torch.get_num_threads).result() == 1


def test_a_bad_load_fails_its_call_and_the_engine_goes_on(backend):
    ids = backend.tokenize(PREFIX)
    bad = torch.zeros(backend.num_layers, 2, backend.kv_heads + 1, 8, backend.head_dim)
    with pytest.raises(ValueError, match="cannot be resumed"):
        backend.generate(ids, bad, GREEDY)
    assert backend.generate(ids, None, GREEDY).token_ids


def _hits(backend, ids, namespace, kv=None):
    """The engine's own prefix-cache hit tokens for one request of ``namespace``, and its result."""
    before = backend.counters["engine_prefix_hit_tokens"]
    got = backend.generate(ids, kv, GREEDY, namespace=namespace)
    return backend.counters["engine_prefix_hit_tokens"] - before, got


def test_a_namespace_never_hits_another_namespaces_blocks_in_the_engine(backend):
    """The same document, other questions: hits within a namespace, none across, for text
    requests and for blocks our connector loaded into the engine."""
    doc = backend.tokenize(PREFIX)
    asks = [backend.tokenize(PREFIX + suffix) for _, suffix in PARTS]
    backend.reset_engine_cache()
    first, want = _hits(backend, asks[0], "tenant-a")
    across, other = _hits(backend, asks[1], "tenant-b")
    within, same = _hits(backend, asks[1], "tenant-a")
    assert first == 0 and across == 0 and within > 0
    assert other.token_ids == same.token_ids  # the salt changes what is shared, never the tokens
    assert other.prefill_tokens == len(asks[1])  # tenant-b computed the whole prompt itself
    # A state loaded into the engine by tenant-a's resume: its blocks are tenant-a's too.
    kv = backend.kv_from_cache(backend.prefill(doc, namespace="tenant-a")[0])
    backend.reset_engine_cache()
    _, resumed = _hits(backend, asks[2], "tenant-a", kv[:, :, :, : len(doc) - 1])
    across, _ = _hits(backend, asks[2], "tenant-b")
    within, replay = _hits(backend, asks[2], "tenant-a")
    assert across == 0 and within > 0
    assert resumed.token_ids == replay.token_ids


def test_a_failed_step_leaves_no_unwritten_block_in_the_engine_cache(backend):
    """vLLM enters a prompt's blocks in its prefix cache when it schedules them; a forward
    that raises leaves them unwritten. The engine drops its cache before the next request:
    the same prompt again hits nothing and gives replay's tokens. A step failing once is
    retried; a request whose retry fails too gets the error, naming the engine."""
    from dask_kvstate.errors import EngineFailed
    from dask_kvstate.testing.engine_faults import fail_steps

    ids = backend.tokenize(PREFIX + PARTS[2][1])
    backend.reset_engine_cache()
    replay = backend.generate(ids, None, GREEDY, namespace="t")
    backend.reset_engine_cache()
    fail_steps(backend, 2)  # the request's step and its retry
    with pytest.raises(EngineFailed, match="failed a step"):
        backend.generate(ids, None, GREEDY, namespace="t")
    hits, again = _hits(backend, ids, "t")
    assert hits == 0 and again.token_ids == replay.token_ids
    backend.reset_engine_cache()
    fail_steps(backend, 1)  # once: the retry passes
    retried = backend.exchange.counters["retried_requests"]
    rows_ok = backend.generate(ids, None, GREEDY, namespace="t")
    assert rows_ok.token_ids == replay.token_ids
    assert backend.exchange.counters["retried_requests"] == retried + 1
    # A state's load in a failed step: retried with the same load, same tokens.
    doc = backend.tokenize(PREFIX)
    kv = backend.kv_from_cache(backend.prefill(doc, namespace="t")[0])
    backend.reset_engine_cache()
    fail_steps(backend, 1)
    loaded = backend.generate(ids, kv[:, :, :, : len(doc) - 1], GREEDY, namespace="t")
    assert loaded.token_ids == replay.token_ids


@pytest.fixture(scope="module")
def two_engines():
    """A client of two worker processes with a vLLM engine each (64-token blocks, whatever an
    earlier test left set; the pull rule: short prompts could make the rule recompute)."""
    settings = dask.config.set({"kvstate.placement.rule": "pull", "kvstate.block-tokens": 64, **SPAWNED, **COMPILED})
    with settings, LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            kvs.install(client, "smollm2-135m", backend="vllm")
            yield client


def _reset_engines(client) -> None:
    from dask_kvstate.bench import workload

    workload.settle(client)  # the last test's tasks forgotten, the stores and engine caches emptied


def test_every_path_on_two_engines_is_token_identical_to_replay(two_engines, hf_model):
    """Worker A's engine makes the state; worker B's engine, which never saw it, resumes it.
    Both engines compiled (the default), their replay equal to transformers' ``generate``."""
    client = two_engines
    _reset_engines(client)
    a, b = sorted(client.nthreads())
    with on(a):
        state = kvs.materialize(PREFIX)
    with on(b):
        resumed = [kvs.resume(s, suffix, max_new_tokens=8) for s, (_, suffix) in zip(kvs.fork(state, 3), PARTS)]
        batched = kvs.resume_many(state, [suffix for _, suffix in PARTS], max_new_tokens=8)
        longer = kvs.extend(state, PARTS[0][1])
        from_longer = kvs.resume(longer, " In short,", max_new_tokens=8)
    with on(a):  # replay on the other engine: the same engine build, the same tokens
        replay = [kvs.generate(p, s, max_new_tokens=8) for p, s in PARTS]
        replay_longer = kvs.generate(PARTS[0][0] + PARTS[0][1] + " In short,", max_new_tokens=8)
    ref, got, got_batched, got_longer, want, want_longer = dask.compute(
        state, resumed, batched, from_longer, replay, replay_longer
    )
    with on(a):  # the extension's own blocks, stored on B from its engine, pulled back to A
        got_longer_on_a = kvs.resume(longer, " In short,", max_new_tokens=8).compute()
    stats = kvs.stats(client).workers
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.token_ids for g in got_batched] == [w.token_ids for w in want]
    assert got_longer.token_ids == want_longer.token_ids == got_longer_on_a.token_ids
    assert all(g.reused_tokens >= ref.num_tokens // 64 * 64 for g in got)
    assert stats[b]["transfer_bytes"] >= ref.nbytes // 2  # B pulled A's blocks over the comm
    assert stats[b]["engine"]["loaded_tokens"] > 0  # and its engine got them through our connector
    assert stats[a]["engine"]["engine"] == "vllm"
    assert stats[a]["engine"]["compiled"] and stats[b]["engine"]["compiled"]
    tokenize = workload.tokenizer_of("smollm2-135m")
    for (prefix, suffix), replayed in zip(PARTS, want):
        ids = tokenize(prefix + suffix)
        assert replayed.token_ids == transformers_continuation(hf_model, ids, 8)[: len(replayed.token_ids)]


def test_the_compiler_on_vllm_is_token_identical(two_engines):
    """Plain ``kvs.generate`` calls sharing a long prompt prefix: the compiler makes it a state."""
    client = two_engines

    def graph():
        return [kvs.generate(PREFIX, suffix, max_new_tokens=8) for _, suffix in PARTS]

    _reset_engines(client)
    off = compute_released(*graph())
    _reset_engines(client)
    before = kvs.stats(client).workers
    with kvs.stateflow():
        got = dask.compute(*graph())
    after = kvs.stats(client).workers

    def engine(counter: str) -> int:
        return sum(after[w]["engine"][counter] - before[w]["engine"][counter] for w in after)

    assert [g.token_ids for g in got] == [o.token_ids for o in off]
    assert all(o.reused_tokens == 0 for o in off)
    assert all(g.reused_tokens >= len(PREFIX) // 8 for g in got)  # the shared prefix came from the state
    # The state's engine serves it from its own prefix cache, the other engine loads it through our connector.
    assert engine("engine_prefix_hit_tokens") + engine("loaded_tokens") > 0


def test_a_prompt_parting_inside_a_block_loads_the_tokens_it_shares(two_engines):
    """The local prefix cache's reuse inside a block (``partial_match``) through our
    connector: the engine's own prefix cache emptied between the visits, so the second
    loads every token it shares with the first, a block's leading part included."""
    client = two_engines
    _reset_engines(client)
    a, _ = sorted(client.nthreads())
    (p, first), (_, second) = PARTS[:2]
    tokenize = workload.tokenizer_of("smollm2-135m")
    shared = common_prefix(tokenize(p + first), tokenize(p + second))
    assert shared % 64, "the prompts should part inside a block"

    def visit(suffix):
        with on(a):
            return kvs.generate(p, suffix, max_new_tokens=8, prefix_cache=True).compute()

    visit(first)
    client.run(lambda dask_worker: dask_worker.plugins["kvstate"].runtime.backend.reset_engine_cache(), workers=[a])
    loaded = kvs.stats(client).workers[a]["engine"]["loaded_tokens"]
    got = visit(second)
    with on(a):
        want = kvs.generate(p, second, max_new_tokens=8).compute()
    assert got.reused_tokens == shared and got.token_ids == want.token_ids
    assert kvs.stats(client).workers[a]["engine"]["loaded_tokens"] - loaded == shared


def test_a_conversation_loads_each_answer_it_continues_and_equals_replay(two_engines):
    """A conversation's next prompt is the last one, its answer and more: the local prefix
    cache keeps the answer's KV too, so each turn computes only its new text (the engine's
    own cache emptied before it: what it reuses came from the store), and every answer
    equals text replay on an engine whose cache was emptied."""
    client = two_engines
    _reset_engines(client)
    a, _ = sorted(client.nthreads())
    tokenize = workload.tokenizer_of("smollm2-135m")

    def reset(dask_worker):
        dask_worker.plugins["kvstate"].runtime.backend.reset_engine_cache()

    context, turns = PREFIX, []
    for question in (" Summarize it in one line.", " Name one risk.", " And one fix?"):
        client.run(reset, workers=[a])
        with on(a):
            g = kvs.generate(context, question, max_new_tokens=8, prefix_cache=True).compute()
        turns.append((context + question, g))
        context += question + g
    for i, (prompt, got) in enumerate(turns):
        client.run(reset, workers=[a])
        with on(a):
            want = kvs.generate(prompt, max_new_tokens=8).compute()
        assert got.token_ids == want.token_ids, i
        if i:
            before, answer = turns[i - 1]
            kept = tokenize(before) + answer.token_ids[:-1]
            assert got.reused_tokens == common_prefix(tokenize(prompt), kept), i
            assert got.reused_tokens > len(tokenize(before)), i  # the answer's tokens among them
