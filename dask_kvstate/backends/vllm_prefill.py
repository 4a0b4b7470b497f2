"""Long prefills in kvstate's vLLM engines through torch's fused attention.

vLLM's CPU attention kernel is built for decode: a few query rows against many paged
keys. On a CPU without AVX-512 (its generic ``vec`` kernels) a long causal prefill runs
far slower there than in torch's own ``scaled_dot_product_attention``, whose CPU flash
kernel tiles queries and keys alike; the measured gap is in the vLLM benchmark page. A
workflow's shared context is exactly such a prefill, computed once and read by every
agent after it, so kvstate's engines run the requests of a step that bring
``LONG_QUERY`` new tokens or more through torch's kernel, and every other request of
the step (decode rows, short suffixes) through vLLM's, as before.

vLLM has no switch for this (its older CPU backend's SDPA prefill is gone in 0.32), so
the engine's CPU attention backend is subclassed and put in its place through vLLM's
own ``register_backend``, in the worker's process before its engine is built
(``kvstate.vllm.prefill-attention``). Only what the two kernels compute alike is taken
over: decoder self-attention, no sliding window, ALiBi, soft cap or sinks, an
unquantized cache in the ``vec`` layout (keys stored per block as
``[head_dim, block]``, values as ``[block, head_dim]``); anything else stays on vLLM's
kernel. Both kernels accumulate in fp32; their outputs differ in the last bits, as
vLLM's own do between thread counts and chunkings.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from vllm.v1.attention.backends import cpu_attn

logger = logging.getLogger("dask_kvstate")

#: A request of a step bringing this many new tokens or more attends through torch's kernel.
LONG_QUERY = 256

#: vLLM's CPU kernel variants whose paged layout :func:`_paged_kv` reads.
LAYOUTS = ("vec",)


def wanted(choice: str) -> bool:
    """Whether ``kvstate.vllm.prefill-attention`` (``auto``, ``torch`` or ``vllm``) puts long
    prefills on torch's kernel here: ``auto`` does where vLLM runs its generic kernel (no
    AVX-512), the only CPUs it was measured faster on."""
    if choice not in ("auto", "torch", "vllm"):
        raise ValueError(f"kvstate.vllm.prefill-attention is {choice!r}; expected 'auto', 'torch' or 'vllm'")
    if choice == "auto":
        return not torch.cpu._is_avx512_supported()
    return choice == "torch"


def use(choice: str) -> bool:
    """Make the engines this process builds next run long prefills as ``choice`` says
    (:func:`wanted`): :class:`FusedPrefillBackend` registered as vLLM's CPU attention
    backend, or vLLM's own put back. Whether torch's kernel is in place."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    fused = wanted(choice)
    backend = FusedPrefillBackend if fused else cpu_attn.CPUAttentionBackend
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{backend.__module__}.{backend.__qualname__}")
    return fused


class FusedPrefillImpl(cpu_attn.CPUAttentionBackendImpl):
    """vLLM's CPU attention, with the long queries of a step through torch's SDPA."""

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: cpu_attn.CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer's attention for a step, into ``output``: the step's requests of
        :data:`LONG_QUERY` new tokens or more through torch's kernel, the others through
        vLLM's (all of them, where the layer is not one torch's kernel computes alike)."""
        md = attn_metadata
        if md is None or md.max_query_len < LONG_QUERY or not self._same_math(layer):
            return super().forward(layer, query, key, value, kv_cache, md, output, output_scale, output_block_scale)
        starts = md.query_start_loc.tolist()
        seq_lens = md.seq_lens.tolist()
        spans = list(itertools.pairwise(starts))
        long = [i for i, (a, b) in enumerate(spans) if b - a >= LONG_QUERY]
        short = [i for i, (a, b) in enumerate(spans) if b - a < LONG_QUERY]
        if short:
            self._vllm_kernel(short, layer, query, kv_cache, md, output, spans, seq_lens)
        for i in long:
            a, b = spans[i]
            q = query[a:b].transpose(0, 1).unsqueeze(0)  # 1, heads, new tokens, head_dim
            if b - a == seq_lens[i]:  # the whole sequence is new: its keys are this step's
                k, v = key[a:b].transpose(0, 1), value[a:b].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    q, k.unsqueeze(0), v.unsqueeze(0), is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:  # a later chunk, or a prompt after a cached prefix: every key from the cache
                k, v = _paged_kv(kv_cache, md.block_table[i], seq_lens[i])
                # The new tokens are the sequence's last: causal aligned to the bottom right.
                mask = torch.ones(b - a, seq_lens[i], dtype=torch.bool).tril(seq_lens[i] - (b - a))
                o = F.scaled_dot_product_attention(
                    q, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=self.scale, enable_gqa=True
                )
            output[a:b].copy_(o[0].transpose(0, 1).reshape(output[a:b].shape))
        return output

    def _same_math(self, layer: Any) -> bool:
        """Whether torch's kernel computes what vLLM's would for this layer (see the module)."""
        return (
            self.attn_type == cpu_attn.AttentionType.DECODER
            and getattr(layer, "isa", None) in LAYOUTS
            and self.sliding_window == -1
            and self.alibi_slopes is None
            and not self.logits_soft_cap
            and self.sinks is None
            and self.kv_cache_dtype == "auto"
        )

    def _vllm_kernel(self, rows, layer, query, kv_cache, md, output, spans, seq_lens) -> None:
        """vLLM's kernel on the step's requests ``rows`` alone (their queries gathered)."""
        from vllm import _custom_ops as ops
        from vllm import envs

        index = torch.cat([torch.arange(*spans[i]) for i in rows])
        starts = torch.tensor([0, *itertools.accumulate(spans[i][1] - spans[i][0] for i in rows)], dtype=torch.int32)
        lens = torch.tensor([seq_lens[i] for i in rows], dtype=torch.int32)
        plan = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(rows), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_size,
            seq_lens=lens, dtype=query.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1,
            isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype="auto",
        )  # fmt: skip
        key_cache, value_cache = _halves(kv_cache)
        q = query[index]
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=lens, scale=self.scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=md.block_table[rows], softcap=0, scheduler_metadata=plan, s_aux=None, dynamic_causal=None,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype="auto",
        )  # fmt: skip
        output[index] = out.reshape(output[index].shape)


class FusedPrefillBackend(cpu_attn.CPUAttentionBackend):
    """vLLM's CPU attention backend with :class:`FusedPrefillImpl` as its implementation."""

    @staticmethod
    def get_impl_cls() -> type[cpu_attn.CPUAttentionBackendImpl]:
        return FusedPrefillImpl


def _halves(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of a layer's cache, as vLLM's CPU backend views them."""
    blocks, kv_heads, block, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(blocks, kv_heads, 2 * block, -1).chunk(2, dim=2)
    return key_cache, value_cache


def _paged_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's first ``tokens`` keys and values, ``[kv_heads, tokens, head_dim]`` each,
    gathered from its blocks (the ``vec`` layout: see the module)."""
    key_cache, value_cache = _halves(kv_cache)
    n = -(-tokens // key_cache.shape[2])
    blocks = block_table[:n].long()
    _, kv_heads, block, head_dim = key_cache.shape
    keys = key_cache[blocks].reshape(n, kv_heads, head_dim, block).transpose(-1, -2)
    values = value_cache[blocks]
    keys = keys.permute(1, 0, 2, 3).reshape(kv_heads, n * block, head_dim)[:, :tokens]
    values = values.permute(1, 0, 2, 3).reshape(kv_heads, n * block, head_dim)[:, :tokens]
    return keys, values
