"""Shared-prefix attention against sdpa over each row's concatenated keys (random tensors, exact shapes)."""

from __future__ import annotations

import pytest
import torch

from dask_kvstate.backends.cascade import SharedPrefixKV, _partial

H, G, D, P = 2, 3, 16, 40  # kv heads, query heads per kv head, head dim, prefix tokens


def reference(query, prefix, own_k, own_v, prefix_lengths, offsets, scale):
    """Row by row: sdpa over the row's visible prefix plus its own tokens, causal over the own ones."""
    B, _, q, _ = query.shape
    out = []
    for b in range(B):
        p, o = prefix_lengths[b], offsets[b]
        k = torch.cat((prefix[0, 0, :, :p], own_k[0, b, :, : o + q]), dim=1)
        v = torch.cat((prefix[0, 1, :, :p], own_v[0, b, :, : o + q]), dim=1)
        see = torch.ones(q, p + o + q, dtype=torch.bool)
        see[:, p:] = torch.arange(o + q)[None, :] <= (o + torch.arange(q))[:, None]
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[b : b + 1], k[None], v[None], attn_mask=see, scale=scale, enable_gqa=True
            )
        )
    return torch.cat(out).transpose(1, 2)


@pytest.mark.parametrize("q", [1, 5])
@pytest.mark.parametrize("prefix_lengths", [[P, P, P], [P, 17, 0]], ids=["whole-prefix", "ragged-prefix"])
def test_cascade_attention_equals_sdpa_over_the_concatenated_keys(q, prefix_lengths):
    g = torch.Generator().manual_seed(3)
    B, scale = len(prefix_lengths), D**-0.5
    prefix = torch.randn(1, 2, H, P, D, generator=g)
    kv = SharedPrefixKV(
        prefix, prefix_lengths, capacity=12, num_layers=1, kv_heads=H, head_dim=D, dtype=torch.float32, device="cpu"
    )
    # Rows already hold 4 own tokens; a decode step's rows may differ in offset, a prefill's may not.
    history_k, history_v = torch.randn(2, B, H, 4, D, generator=g)
    kv.own_k[0, :, :, :4], kv.own_v[0, :, :, :4] = history_k, history_v
    kv.advance([4] * B)
    if q == 1:
        kv.advance([0, 2, 1])
    offsets = kv.offsets.tolist()
    query = torch.randn(B, H * G, q, D, generator=g)
    key, value = torch.randn(2, B, H, q, D, generator=g)
    kv.begin(q)
    got = kv.attend(0, query, key, value, scale)
    want = reference(query, prefix, kv.own_k, kv.own_v, prefix_lengths, offsets, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cascade_attention_with_values_narrower_than_keys():
    """MLA-shaped heads: 16-wide keys, 8-wide values, the stored prefix's values zero-padded to 16."""
    g = torch.Generator().manual_seed(7)
    Dv, prefix_lengths, q = 8, [P, 17], 3
    B, scale = len(prefix_lengths), 0.3
    k_prefix, v_prefix = torch.randn(H, P, D, generator=g), torch.randn(H, P, Dv, generator=g)
    stored = torch.stack((k_prefix, torch.nn.functional.pad(v_prefix, (0, D - Dv))))[None]  # as layout.kv_of pads
    kv = SharedPrefixKV(
        stored, prefix_lengths, capacity=8, num_layers=1, kv_heads=H, head_dim=D, dtype=torch.float32, device="cpu"
    )
    query, key = torch.randn(2, B, H * G, q, D, generator=g)[0], torch.randn(B, H, q, D, generator=g)
    value = torch.randn(B, H, q, Dv, generator=g)
    kv.begin(q)
    got = kv.attend(0, query, key, value, scale)
    assert got.shape == (B, q, H * G, Dv)
    want = []
    for b, p in enumerate(prefix_lengths):
        k = torch.cat((k_prefix[:, :p], key[b]), dim=1)[None]
        v = torch.cat((v_prefix[:, :p], value[b]), dim=1)[None]
        see = torch.ones(q, p + q, dtype=torch.bool)
        see[:, p:] = torch.tril(torch.ones(q, q, dtype=torch.bool))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        want.append(sdpa(query[b : b + 1], k, v, attn_mask=see, scale=scale, enable_gqa=True))
    torch.testing.assert_close(got, torch.cat(want).transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_fused_and_matmul_partials_agree_on_output_and_lse():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, H, 24, D, generator=g)
    k, v = torch.randn(2, 1, H, 30, D, generator=g).unbind(0)
    hide = torch.rand(1, 1, 24, 30, generator=g) < 0.3
    mask = torch.zeros(hide.shape).masked_fill_(hide, torch.finfo(torch.float32).min)
    fused = _partial(q, k, v, mask, 0.25, fused=True)
    plain = _partial(q, k, v, mask, 0.25, fused=False)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
