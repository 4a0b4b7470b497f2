"""The transformers backend on tiny-llama: names, fingerprints, KV round trips, decoding."""

from __future__ import annotations

import pytest
import torch

from dask_kvstate.backends import check_model_name, load_backend
from dask_kvstate.blocks import block_hashes, join_blocks
from dask_kvstate.generation import Sampling
from dask_kvstate.plugins.worker.arena import split_blocks

from .conftest import CONTEXT


def test_unknown_model_lists_known_names():
    with pytest.raises(ValueError, match="unknown model 'llama-9000'.*smollm2-135m, tiny-llama"):
        load_backend("llama-9000")
    with pytest.raises(ValueError, match="non-empty str"):
        check_model_name("")


def test_fingerprints_are_stable_and_describe_the_kv_layout(backend):
    again = load_backend("tiny-llama")
    assert again.model_fingerprint == backend.model_fingerprint
    assert again.config_fingerprint == backend.config_fingerprint
    assert backend.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers * (K,V) * kv_heads * head_dim * fp32


def test_resume_from_any_split_is_token_identical_to_text_replay(backend):
    ids = backend.tokenize(CONTEXT + "Question: who tries again?")
    replay = backend.generate(ids, None, Sampling(max_new_tokens=24))
    assert len(replay.token_ids) > 0
    for split in range(1, len(ids), 7):
        cache, _ = backend.prefill(ids[:split])
        kv = backend.kv_from_cache(cache)
        out = backend.generate(ids, kv, Sampling(max_new_tokens=24))
        assert out.token_ids == replay.token_ids, f"split at {split}"
        assert out.reused_tokens == split and out.prefill_tokens == len(ids) - split


def test_a_reuse_hands_on_the_prompts_kv_as_transformers_cache_holds_it(backend):
    """A generate with a state reads it in place (no DynamicCache); what it hands ``on_prefill``
    gives the store the same blocks, from any start, as a text replay's cache does."""
    ids = backend.tokenize(CONTEXT + "Question: who tries again?")
    starts = (0, 16, 32, 48)

    def keep(into: list):  # the hook copies at once, as the prefix cache's does: decoding goes on after it
        return lambda cache: into.append((type(cache).__name__, [backend.kv_to_store(cache, s, 16) for s in starts]))

    replayed: list = []
    replay = backend.generate(ids, None, Sampling(max_new_tokens=6), on_prefill=keep(replayed))
    state = backend.kv_from_cache(backend.prefill(ids[:32])[0])
    reused: list = []
    out = backend.generate(ids, state, Sampling(max_new_tokens=6), on_prefill=keep(reused))
    assert out.token_ids == replay.token_ids and out.reused_tokens == 32
    assert reused[0][0] == "PromptKV"  # the state was read in place, not copied into a cache
    for start, want, got in zip(starts, replayed[0][1], reused[0][1]):
        assert [b.shape for b in got.blocks] == [b.shape for b in want.blocks], f"from {start}"
        assert torch.allclose(got.joined(), want.joined(), atol=1e-5), f"from {start}"


def test_a_generation_hands_on_its_prompt_and_answer_kv_on_both_paths(backend):
    """``on_sequence``, after decoding: the KV of the prompt and of every generated token but
    the last (no forward computed its KV), with those tokens' ids; text replay through
    transformers' cache and a reuse read in place hand the same, equal to a prefill of the
    same ids, and decode the same tokens."""
    ids = backend.tokenize(CONTEXT + "Question: who tries again?")
    sampling = Sampling(max_new_tokens=12)

    def keep(into: list):
        return lambda cache, seq: into.append((seq, backend.kv_to_store(cache, 16, 16).joined()))

    replayed: list = []
    replay = backend.generate(ids, None, sampling, on_sequence=keep(replayed))
    state = backend.kv_from_cache(backend.prefill(ids[:32])[0])
    reused: list = []
    out = backend.generate(ids, state, sampling, on_sequence=keep(reused))
    assert out.token_ids == replay.token_ids and len(replay.token_ids) > 1
    seq = ids + replay.token_ids[:-1]
    whole = backend.kv_from_cache(backend.prefill(seq)[0])[:, :, :, 16:]
    for handed in (replayed, reused):
        ((got_seq, kv),) = handed
        assert got_seq == seq
        torch.testing.assert_close(kv, whole, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        backend.generate(ids, None, sampling, on_prefill=print, on_sequence=print)


def test_blocks_round_trip_and_are_never_mutated_by_a_forward_pass(backend):
    ids = backend.tokenize(CONTEXT)
    kv = backend.kv_from_cache(backend.prefill(ids)[0])
    hashes = block_hashes(ids, identity=backend.kv_identity, namespace="t", block_tokens=16)
    blocks = split_blocks(kv, hashes, 16)
    assert [b.start for b in blocks[:3]] == [0, 16, 32] and blocks[-1].num_tokens == len(ids) - 16 * (len(blocks) - 1)
    joined = join_blocks([b.tensor for b in blocks])
    assert torch.equal(joined, kv)
    snapshot = [b.tensor.clone() for b in blocks]
    backend.generate(ids + backend.tokenize(" more"), joined, Sampling(max_new_tokens=4))
    assert all(torch.equal(a, b.tensor) for a, b in zip(snapshot, blocks))


def test_seeded_sampling_is_reproducible(backend):
    ids = backend.tokenize(CONTEXT)
    a = backend.generate(ids, None, Sampling(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7))
    b = backend.generate(ids, None, Sampling(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7))
    c = backend.generate(ids, None, Sampling(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=8))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_unseeded_sampling_leaves_torchs_global_generator_alone(backend):
    ids = backend.tokenize(CONTEXT)
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    a = backend.generate(ids, None, Sampling(max_new_tokens=6, temperature=0.9))  # no seed: a fresh one
    assert torch.equal(torch.random.get_rng_state(), before) and torch.initial_seed() == 1234
    # A fresh seed each call, so the draw may end at an end-of-sequence token early.
    assert len(a.token_ids) == 6 or (0 < len(a.token_ids) < 6 and a.token_ids[-1] in backend.eos_ids)


def test_local_model_folder_loads_like_a_named_model(tmp_path, backend):
    backend.model.save_pretrained(tmp_path)
    backend.tokenizer.save_pretrained(tmp_path)
    folder = load_backend(str(tmp_path))
    assert folder.config_fingerprint == backend.config_fingerprint
    ids = backend.tokenize(CONTEXT)
    assert (
        folder.generate(ids, None, Sampling(max_new_tokens=8)).token_ids
        == backend.generate(ids, None, Sampling(max_new_tokens=8)).token_ids
    )
