"""Long prefills through torch's SDPA in kvstate's vLLM engines (``backends/vllm_prefill.py``).

One attention step of vLLM's CPU backend, computed by vLLM's own implementation and by
kvstate's, on the same paged cache written by vLLM's own cache writer: a step that mixes
every kind of request (a whole prompt, a later chunk over its cached first chunk, a
prompt after a cached prefix shorter than a block's multiple, a short suffix, decode rows)
gives the same outputs within fp32 rounding (vLLM's kernel plans its work by the step's
requests, so even its own rows move in the last bits with the company they keep); a
step without a long request is vLLM's own, bit for bit. The engine
paths (a context's prefill, then its branches) are checked token for token against text
replay and raw vLLM in ``tests/test_vllm.py``, ``test_sessions_vs_raw.py`` and
``test_beyond_memory.py``, whose prompts run past ``LONG_QUERY``.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops
from vllm.config import set_current_vllm_config
from vllm.v1.attention.backends import cpu_attn

from dask_kvstate.backends import models, vllm_prefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 64  # SmolLM2-135M's, and kvstate's block size


def _step(requests: list[tuple[int, int]], seed: int = 0):
    """A step over ``requests`` (tokens already cached, new tokens) each: the query, this
    step's keys and values, the layer's paged cache holding every token, and the metadata
    vLLM's CPU backend builds for it."""
    gen = torch.Generator().manual_seed(seed)
    blocks_of = [-(-(cached + new) // BLOCK) for cached, new in requests]
    cache = torch.zeros(sum(blocks_of), KV_HEADS, BLOCK, 2 * HEAD_DIM)
    key_cache, value_cache = cache.view(sum(blocks_of), KV_HEADS, 2 * BLOCK, HEAD_DIM).chunk(2, dim=2)
    table = torch.zeros(len(requests), max(blocks_of), dtype=torch.int32)
    queries, keys, values, first = [], [], [], 0
    for r, ((cached, new), n) in enumerate(zip(requests, blocks_of)):
        # Blocks in reverse order: a request's blocks need not be consecutive in the cache.
        table[r, :n] = torch.arange(first + n - 1, first - 1, -1, dtype=torch.int32)
        first += n
        total = cached + new
        k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
        slots = table[r].long()[torch.arange(total) // BLOCK] * BLOCK + torch.arange(total) % BLOCK
        ops.cpu_attn_reshape_and_cache(
            k, v, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
        )
        queries.append(torch.randn(new, HEADS, HEAD_DIM, generator=gen))
        keys.append(k[cached:])
        values.append(v[cached:])
    news = [new for _, new in requests]
    starts = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in requests], dtype=torch.int32)
    plan = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(requests), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=seq_lens,
        dtype=torch.float32, query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec",
        enable_kv_split=True, dynamic_causal=None, kv_cache_dtype="auto",
    )  # fmt: skip
    md = cpu_attn.CPUAttentionMetadata(
        num_actual_tokens=sum(news), max_query_len=max(news), query_start_loc=starts, max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens, block_table=table, slot_mapping=torch.zeros(sum(news), dtype=torch.int64),
        scheduler_metadata=plan,
    )  # fmt: skip
    return torch.cat(queries), torch.cat(keys), torch.cat(values), cache, md


@functools.cache
def _config():
    """The engine config of SmolLM2-135M fp32, whose attention shape the steps have."""
    from vllm.config import ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=str(models.folder("smollm2-135m")), dtype="float32"))


def _attend(impl_cls, step) -> torch.Tensor:
    query, key, value, cache, md = step
    with set_current_vllm_config(_config()):  # what an engine's layers are built under
        impl = impl_cls(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, None, None, "auto")
    layer = types.SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
    out = torch.full_like(query, float("nan"))
    return impl.forward(layer, query, key, value, cache, md, out)


def test_a_step_mixing_long_and_short_requests_attends_as_vllms_kernel_does():
    # (cached, new): a whole prompt; a second chunk over its first; a prompt after a
    # cached prefix ending mid-block; a short suffix after a long prefix; two decode rows.
    requests = [(0, 700), (512, 300), (1000, 400), (800, 20), (1500, 1), (90, 1)]
    step = _step(requests)
    want = _attend(cpu_attn.CPUAttentionBackendImpl, step)
    got = _attend(vllm_prefill.FusedPrefillImpl, step)
    assert not got.isnan().any(), "a request's rows were left unwritten"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_step_of_short_requests_alone_is_vllms_own():
    step = _step([(300, 1), (64, 17), (0, 200)], seed=1)
    assert torch.equal(_attend(vllm_prefill.FusedPrefillImpl, step), _attend(cpu_attn.CPUAttentionBackendImpl, step))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block", [32, 64, 128])
def test_a_requests_keys_and_values_read_back_from_vllms_pages(head_dim, block):
    """The paged layout the prefill reads is the one vLLM's cache writer leaves, for the
    head sizes of the models kvstate serves and the block sizes vLLM's CPU backend takes."""
    tokens, kv_heads = 300, 2
    n = -(-tokens // block)
    cache = torch.zeros(n + 2, kv_heads, block, 2 * head_dim)
    key_cache, value_cache = vllm_prefill._halves(cache)
    table = torch.arange(n + 1, 1, -1, dtype=torch.int32)  # blocks out of order, two left unused
    k, v = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    slots = table.long()[torch.arange(tokens) // block] * block + torch.arange(tokens) % block
    ops.cpu_attn_reshape_and_cache(
        k, v, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    keys, values = vllm_prefill._paged_kv(cache, table, tokens)
    assert torch.equal(keys, k.transpose(0, 1)) and torch.equal(values, v.transpose(0, 1))


def test_the_choice_is_named_and_auto_follows_the_cpu():
    assert vllm_prefill.wanted("torch") and not vllm_prefill.wanted("vllm")
    assert vllm_prefill.wanted("auto") == (not torch.cpu._is_avx512_supported())
    with pytest.raises(ValueError, match="prefill-attention is 'sdpa'"):
        vllm_prefill.wanted("sdpa")


def test_use_puts_the_backend_in_vllms_registry_and_takes_it_back():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        assert vllm_prefill.use("torch")
        assert AttentionBackendEnum.CPU_ATTN.get_class() is vllm_prefill.FusedPrefillBackend
        assert not vllm_prefill.use("vllm")
        assert AttentionBackendEnum.CPU_ATTN.get_class() is cpu_attn.CPUAttentionBackend
    finally:
        vllm_prefill.use("vllm")
