"""Reuse inside a block (``plugins/worker/partial_match.py``): a prompt that leaves a stored
prompt's chain inside a block reuses the tokens the two share there, as many as they
share, within its namespace only, and its output is text replay's token for token."""

from __future__ import annotations

import pytest

import dask_kvstate as kvs
from dask_kvstate.plugins.worker.partial_match import BlockChildren
from dask_kvstate.plugins.worker.runtime import common_prefix

from .conftest import CONTEXT, TEST_CONFIG, on, stats_of

BLOCK = TEST_CONFIG["kvstate.block-tokens"]
DOC = "Header. Partial-block check. " + CONTEXT
FIRST, SECOND = " Which role reads the plan first, and why?", " Which role writes the code?"


@pytest.fixture
def parting(backend):
    """The two visits' prompts in tokens, checked to part inside a block, and where."""
    a, b = backend.tokenize(DOC + FIRST), backend.tokenize(DOC + SECOND)
    shared = common_prefix(a, b)
    assert shared % BLOCK, "the prompts should part inside a block, not on a boundary"
    return shared


def visit(worker, question, namespace, **options):
    with on(worker):
        return kvs.generate(DOC, question, max_new_tokens=8, prefix_cache=True, namespace=namespace, **options)


def replay(question):
    return kvs.generate(DOC, question, max_new_tokens=8).compute().token_ids


def counter(client, worker, name) -> int:
    return stats_of(client, worker).get(name, 0)


def test_a_returning_visit_reuses_every_token_it_shares(client, workers, parting):
    w = workers[0]
    first = visit(w, FIRST, "partial-a").compute()
    hits = counter(client, w, "partial_block_hits")
    second = visit(w, SECOND, "partial-a").compute()
    assert first.reused_tokens == 0
    # Every shared token, not only the whole blocks' (parting // BLOCK * BLOCK of them).
    assert second.reused_tokens == parting and second.prefill_tokens == second.prompt_tokens - parting
    assert counter(client, w, "partial_block_hits") == hits + 1
    assert first.token_ids == replay(FIRST) and second.token_ids == replay(SECOND)


def test_a_conversations_next_turn_reuses_the_last_prompt_whole(client, workers, backend):
    w, turn = workers[0], " The tester reports two failures."
    first = visit(w, FIRST, "partial-turns").compute()
    again = visit(w, FIRST + turn, "partial-turns").compute()
    ids, more = backend.tokenize(DOC + FIRST), backend.tokenize(DOC + FIRST + turn)
    assert len(ids) % BLOCK, "the first prompt should end inside a block"
    assert again.reused_tokens == common_prefix(ids, more) > len(ids) // BLOCK * BLOCK
    assert first.token_ids == replay(FIRST) and again.token_ids == replay(FIRST + turn)


def test_a_conversations_next_turn_reuses_the_last_answer_too(client, workers, backend):
    """The next turn's prompt is the last one, its answer and more: the answer's KV was kept
    (``on_sequence``), so the turn computes only its new text, and equals text replay."""
    w, turn = workers[0], " The tester reports two failures."
    first = visit(w, FIRST, "partial-answers").compute()
    again = visit(w, FIRST + first + turn, "partial-answers").compute()
    ids = backend.tokenize(DOC + FIRST)
    kept = ids + first.token_ids[:-1]
    assert again.reused_tokens == common_prefix(backend.tokenize(DOC + FIRST + first + turn), kept) > len(ids)
    assert again.token_ids == replay(FIRST + first + turn)


def test_a_whole_block_prompt_stored_whole_is_served_again_with_one_new_token(client, workers, backend):
    """A prompt of whole blocks the store holds every one of, asked again for one token: the
    call has nothing to store (its answer's only token has no KV) and still reuses it all."""
    w = workers[0]
    text = next(DOC + " x" * n for n in range(2 * BLOCK) if len(backend.tokenize(DOC + " x" * n)) % BLOCK == 0)
    ids = backend.tokenize(text)
    with on(w):
        first = kvs.generate(text, max_new_tokens=4, prefix_cache=True, namespace="whole").compute()
        again = kvs.generate(text, max_new_tokens=1, prefix_cache=True, namespace="whole").compute()
    assert again.reused_tokens == len(ids) - 1 and again.token_ids == first.token_ids[:1]


def test_another_namespace_reuses_nothing_inside_a_block(client, workers):
    w = workers[1]
    visit(w, FIRST, "partial-owner").compute()
    hits = counter(client, w, "partial_block_hits")
    stranger = visit(w, SECOND, "partial-stranger").compute()
    assert stranger.reused_tokens == 0 and counter(client, w, "partial_block_hits") == hits
    assert stranger.token_ids == replay(SECOND)


def test_a_block_gone_from_the_store_is_computed_again(client, workers, parting):
    w = workers[1]
    visit(w, FIRST, "partial-gone").compute()

    def drop_parting_block(dask_worker, shared=parting):
        rt = dask_worker.plugins["kvstate"].runtime
        ids = rt.backend.tokenize(DOC + FIRST)
        return rt.store.discard(rt.hashes(ids, "partial-gone")[shared // BLOCK :])

    assert client.run(drop_parting_block, workers=[w])[w] > 0
    back = visit(w, SECOND, "partial-gone").compute()
    assert back.reused_tokens == parting // BLOCK * BLOCK  # the whole blocks only
    assert back.token_ids == replay(SECOND)


def test_sampled_visits_with_reuse_inside_a_block_equal_replay(client, workers, parting):
    w, sampling = workers[0], {"temperature": 0.8, "seed": 11}
    visit(w, FIRST, "partial-sampled", **sampling).compute()
    got = visit(w, SECOND, "partial-sampled", **sampling).compute()
    want = kvs.generate(DOC, SECOND, max_new_tokens=8, **sampling).compute()
    assert got.reused_tokens == parting and got.token_ids == want.token_ids


def test_a_short_stored_prefix_is_computed_again_on_transformers(client, workers, backend):
    """A stored prefix under a quarter of the prompt (a shared header before a new document)
    is not worth its attention path on the transformers backend: the prompt is computed
    whole, the store keeps its blocks, and the output is text replay's."""
    w, header = workers[1], "Header. "
    other = header + "A different document altogether. " * 12
    with on(w):
        kvs.generate(DOC, FIRST, max_new_tokens=4, prefix_cache=True, namespace="partial-short").compute()
    shared = common_prefix(backend.tokenize(DOC + FIRST), backend.tokenize(other))
    assert 0 < 4 * shared < len(backend.tokenize(other)), "the prompts should share a short header"
    declined, hits = counter(client, w, "declined_reuse_tokens"), counter(client, w, "hits")
    with on(w):
        got = kvs.generate(other, max_new_tokens=8, prefix_cache=True, namespace="partial-short").compute()
    assert got.reused_tokens == 0 and got.prefill_tokens == got.prompt_tokens
    assert counter(client, w, "declined_reuse_tokens") == declined + shared
    assert counter(client, w, "hits") == hits  # the block it declined was not even read
    assert got.token_ids == kvs.generate(other, max_new_tokens=8).compute().token_ids


def test_materialize_reuses_a_stored_block_it_parts_from_and_resumes_as_replay(client, workers, parting):
    w = workers[0]
    with on(w):
        kvs.generate(DOC, FIRST, max_new_tokens=2, prefix_cache=True, namespace="partial-state").compute()
        hits = counter(client, w, "partial_block_tokens")
        state = kvs.materialize(DOC + SECOND, namespace="partial-state")
        got = kvs.resume(state, " Answer:", max_new_tokens=8).compute()
    assert counter(client, w, "partial_block_tokens") == hits + parting % BLOCK
    want = kvs.generate(DOC + SECOND + " Answer:", max_new_tokens=8, namespace="partial-state").compute()
    assert got.token_ids == want.token_ids


def test_the_index_finds_the_longest_match_newest_first_and_forgets_the_oldest():
    index = BlockChildren(capacity=3)
    index.add(b"p", b"a", [1, 2, 3, 4, 5, 6])
    index.add(b"p", b"b", [1, 2, 3, 4, 5, 9])
    index.add(b"q", b"c", [1, 2, 3, 4, 5, 6])
    index.add(b"p", b"x", [1, 2, 3])  # too short to be worth finding: not indexed
    assert index.matches(b"p", [1, 2, 3, 4, 5, 6, 7]) == [(b"a", 6), (b"b", 5)]
    assert index.matches(b"p", [1, 2, 3, 4]) == [(b"b", 4), (b"a", 4)]  # equals: the newest first
    index.used(b"a")  # a hit makes it the newest
    assert index.matches(b"p", [1, 2, 3, 4]) == [(b"a", 4), (b"b", 4)]
    index.add(b"p", b"d", [7, 7, 7, 7])  # past capacity: the oldest, b, goes
    assert len(index) == 3 and index.matches(b"p", [1, 2, 3, 4, 5, 9]) == [(b"a", 5)]
    index.forget(b"a")
    assert index.matches(b"p", [1, 2, 3, 4]) == [] and index.matches(b"q", [1, 2, 3, 4]) == [(b"c", 4)]
    assert index.matches(b"p", [1, 2, 3]) == []  # fewer tokens than a match must share
