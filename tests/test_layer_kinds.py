"""KV layout per layer kind, in the backend: sliding windows, hybrids, softcaps, sinks, logit scales.

Every reuse path of the backend (resume from a stored state, batched resume over a
shared prefix with rows keeping different prefix lengths, greedy and seeded sampling)
against text replay, and text replay against transformers' own ``model.generate``,
on tiny random models whose prefix is longer than their sliding window. The cluster
paths of the same families are in ``test_architectures.py``.
"""

from __future__ import annotations

import pytest
import torch

from dask_kvstate.backends import layout
from dask_kvstate.backends.batch import Row, generate_batch
from dask_kvstate.backends.cascade import SharedPrefixKV
from dask_kvstate.backends.hf import HFBackend
from dask_kvstate.generation import Sampling
from dask_kvstate.testing import architectures
from dask_kvstate.testing.architectures import WINDOW

# The families whose layers differ from Llama's in what the backend must honour.
FAMILIES = ("mistral", "qwen2", "gemma2", "gemma3", "gpt_oss", "granite", "cohere")
TEXT = "The planner reads the task and writes a plan. The developer follows the plan and writes the code. " * 3


def tiny(family: str) -> HFBackend:
    model, tokenizer = architectures.model(family)
    return HFBackend(family, model, tokenizer)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_backend_path_equals_model_generate(family):
    backend = tiny(family)
    ids = backend.tokenize(TEXT)
    prefix, suffixes = ids[:60], [ids[60:70], ids[60:75], ids[60:64]]
    assert len(prefix) > 2 * WINDOW
    greedy, sampled = Sampling(10), Sampling(10, temperature=1.0, seed=7)

    def reference(prompt):
        out = backend.model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        return out[0, len(prompt) :].tolist()

    replay = [backend.generate(prefix + s, None, greedy).token_ids for s in suffixes]
    assert replay == [reference(prefix + s)[: len(r)] for s, r in zip(suffixes, replay, strict=True)]

    kv = backend.kv_from_cache(backend.prefill(prefix)[0])
    assert kv.shape[3] == len(prefix)  # every token of every layer, sliding ones included
    assert [backend.generate(prefix + s, kv, greedy).token_ids for s in suffixes] == replay
    for keep in ((60, 60, 60), (60, 33, 17)):
        rows = [Row(prefix + s, k) for s, k in zip(suffixes, keep, strict=True)]
        assert [r.token_ids for r in generate_batch(backend, rows, kv, greedy)] == replay
    # Sampling sees the logits' scale: the first token's post-processing must be the model's own.
    replay_sampled = [backend.generate(prefix + s, None, sampled).token_ids for s in suffixes]
    rows = [Row(prefix + s, 60) for s in suffixes]
    assert [r.token_ids for r in generate_batch(backend, rows, kv, sampled)] == replay_sampled
    assert not backend.cascade_fallbacks  # every family here is served by the fused path


def test_extend_from_mid_window_equals_replay():
    backend = tiny("gemma3")
    ids = backend.tokenize(TEXT)
    short = backend.kv_from_cache(backend.prefill(ids[:37])[0])  # ends inside the second window
    cache = backend.prefill(ids[:60], short)[0]  # sliding layers record two chunks: 37 tokens, then 23
    extended = backend.kv_from_cache(cache)
    direct = backend.kv_from_cache(backend.prefill(ids[:60])[0])
    assert extended.shape == direct.shape == (3, 2, 2, 60, 16)
    for start in (20, 37, 45, 60):  # inside the first chunk, at the second's start, inside it, at the end
        assert torch.equal(backend.kv_from_cache(cache, start), extended[:, :, :, start:])
    torch.testing.assert_close(extended, direct, rtol=1e-4, atol=1e-4)
    tail = ids[60:68]
    want = backend.generate(ids[:60] + tail, None, Sampling(8)).token_ids
    assert backend.generate(ids[:60] + tail, extended, Sampling(8)).token_ids == want


def _dense_reference(q, k, v, positions, key_positions, visible, scale, window, softcap=None, sinks=None):
    """Plain softmax attention over explicit keys: what the cascade must equal."""
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    ok = visible & (key_positions[None, :] <= positions[:, None])
    if window is not None:
        ok &= key_positions[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : k.shape[-2]]
    return probs @ v.float()


@pytest.mark.parametrize("window", [None, 5, 9])
@pytest.mark.parametrize("feature", ["plain", "softcap", "sinks"])
def test_cascade_masks_match_dense_attention(window, feature):
    """Rows keeping different prefix lengths, a prefill then decode steps, against dense attention."""
    torch.manual_seed(0)
    H, g, D, P, keeps, suffix = 2, 2, 8, 12, [12, 7, 3, 0], 4
    prefix = torch.randn(1, 2, H, P, D)
    softcap = 2.0 if feature == "softcap" else None
    sinks = torch.randn(H * g) if feature == "sinks" else None
    kv = SharedPrefixKV(
        prefix,
        keeps,
        suffix + 3,
        num_layers=1,
        kv_heads=H,
        head_dim=D,
        dtype=torch.float32,
        device="cpu",
        windows=[window],
    )
    B = len(keeps)
    own_k, own_v = torch.zeros(B, H, 0, D), torch.zeros(B, H, 0, D)
    for step, q_len in enumerate([suffix, 1, 1, 1]):
        kv.begin(q_len)
        query, key, value = torch.randn(B, H * g, q_len, D), torch.randn(B, H, q_len, D), torch.randn(B, H, q_len, D)
        out = kv.attend(0, query, key, value, 0.3, softcap=softcap, sinks=sinks, window=window)
        own_k, own_v = torch.cat([own_k, key], dim=2), torch.cat([own_v, value], dim=2)
        for b, keep in enumerate(keeps):
            n_own = own_k.shape[2]
            positions = keep + torch.arange(n_own - q_len, n_own)
            key_positions = torch.cat([torch.arange(keep), keep + torch.arange(n_own)])
            keys = torch.cat([prefix[0, 0, :, :keep], own_k[b]], dim=1).repeat_interleave(g, dim=0)
            values = torch.cat([prefix[0, 1, :, :keep], own_v[b]], dim=1).repeat_interleave(g, dim=0)
            visible = torch.ones(q_len, key_positions.numel(), dtype=torch.bool)
            want = _dense_reference(
                query[b],
                keys,
                values,
                positions,
                key_positions,
                visible,
                0.3,
                window,
                softcap,
                sinks[:, None, None] if sinks is not None else None,
            )
            torch.testing.assert_close(
                out[b].transpose(0, 1).float(), want, rtol=1e-4, atol=1e-5, msg=f"step {step} row {b}"
            )
        kv.advance([q_len] * B)


def test_models_without_per_token_kv_are_refused_naming_what_they_lack():
    model, tokenizer = architectures.model("mamba")
    with pytest.raises(ValueError, match=r"'mamba' is not supported.*recurrent"):
        HFBackend("mamba", model, tokenizer)


def test_config_fingerprint_covers_fields_that_change_kv():
    a = tiny("mistral")
    for field, value in (("sliding_window", WINDOW + 8), ("rms_norm_eps", 1e-3), ("hidden_act", "gelu")):
        edited = tiny("mistral")
        setattr(edited.model.config, field, value)
        again = HFBackend("mistral", edited.model, edited.tokenizer)
        assert again.model_fingerprint == a.model_fingerprint  # same weights
        assert again.config_fingerprint != a.config_fingerprint, field


def test_memory_per_token_of_each_layer_kind():
    backend = tiny("gemma3")
    per_kind = layout.memory_per_token(backend.layout, backend.kv_heads, backend.head_dim, backend.dtype)
    assert sum(per_kind.values()) == backend.kv_bytes_per_token
    assert set(per_kind) == {"full_attention", f"sliding_attention(window {WINDOW})"}
