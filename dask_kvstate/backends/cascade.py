"""Decoding many rows over one shared prefix without copying the prefix (cascade attention).

Why: siblings forked from one state share its KV. transformers' ``DynamicCache`` wants
one ``[batch, heads, tokens, dim]`` tensor per layer and grows it with ``torch.cat``,
so batching B siblings means B copies of the prefix, and every decode step copies all
of them again (at L = 4,096 on SmolLM2 that is ~1.5 GB per step for 8 rows). Serving
engines avoid this with cascade / radix attention (FlashInfer's cascade kernels,
SGLang's radix attention, vLLM's shared blocks): attention over the shared prefix is
computed once against the single prefix copy, attention over each row's own tokens
against that row's buffer, and the two are merged exactly by their log-sum-exp.

How, within transformers: the model keeps its attention implementation, but under a
name of ours (:data:`ATTN_NAME`) whose function dispatches: a forward called with the
keyword ``kvstate_cascade=<SharedPrefixKV>`` (transformers passes unknown keywords down
to the attention function) runs :meth:`SharedPrefixKV.attend`; any other call goes to
the implementation the model had (sdpa or eager), with the same arguments, so text
replay and the block-store paths compute exactly what they did. Such a forward runs
with ``cache=None``: the rows' KV lives in the :class:`SharedPrefixKV`, which writes
each layer's new keys and values into preallocated per-row buffers (no ``torch.cat``
per step) and never copies the prefix.

Two partial attentions and a merge (FlashInfer's cascade recipe): for every layer,
(1) all rows' queries, folded into one query batch per kv head, attend to the single
prefix copy; (2) each row's queries attend to its own tokens; each part returns its
output and its log-sum-exp (LSE), and the two are merged exactly:
``o = (o1 e^{l1} + o2 e^{l2}) / (e^{l1} + e^{l2})``. On CPU both parts run torch's fused
flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, the one sdpa itself
uses, which also returns the LSE), so no B x heads x q x P score tensor is built and
the prefix is never expanded per row. Measured on SmolLM2 shapes (8 rows, 4,096-token
prefix, one thread, 30 layers): a decode step's attention 41 ms against 72 ms for the
earlier matmul + softmax split; the suffixes' prefill (36 tokens a row) 1.07 s against
2.2 s for sdpa over the prefix expanded per row. Elsewhere (CUDA, MPS) the parts are
computed with matmuls and ``torch.logsumexp``; same contract, same merge.

Exactness: the result is the same softmax(QK^T)V over the same keys as sdpa over the
concatenated cache, masked per row (row b sees the first ``p_b`` prefix tokens and its
own tokens causally). The arithmetic is split differently, so the last bits of a float
may differ from sdpa's; greedy outputs are checked against text replay token for token
in the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

ATTN_NAME = "kvstate_cascade"

_previous: dict[str, Callable[..., Any]] = {}


def _dispatch(module, query, key, value, attention_mask, *, kvstate_cascade=None, **kwargs):
    if kvstate_cascade is not None:
        return kvstate_cascade.attend(module.layer_idx, query, key, value, kwargs.get("scaling")), None
    base = _previous[module.config._kvstate_base_attn]
    return base(module, query, key, value, attention_mask, **kwargs)


def enable(model) -> bool:
    """Route ``model``'s attention through :func:`_dispatch`; False if the model can't be routed.

    Registers :data:`ATTN_NAME` with transformers' attention and mask interfaces (the
    mask function is the base implementation's, so non-cascade calls are unchanged).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = model.config._attn_implementation
    if base == ATTN_NAME:
        return True
    if base not in ("sdpa", "eager") or base not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return False
    if base == "eager":
        # eager lives in each model's module; take the model's own function.
        import sys

        fn = getattr(sys.modules[type(model).__module__], "eager_attention_forward", None)
        if fn is None:
            return False
        _previous["eager"] = fn
    else:
        _previous["sdpa"] = ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register(ATTN_NAME, _dispatch)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS[base])
    for config in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
        config._kvstate_base_attn = base
    model.set_attn_implementation(ATTN_NAME)
    return model.config._attn_implementation == ATTN_NAME


class SharedPrefixKV:
    """KV for ``rows`` sequences that share one prefix: the prefix once, each row's own tokens apart.

    Parameters
    ----------
    prefix : tensor ``[L, 2, H, P, D]`` or None
        The shared prefix's KV (a view is fine; it is only read).
    prefix_lengths : list of int
        How many prefix tokens row b uses (``<= P``): a sibling whose text re-tokenizes
        differently at the boundary keeps fewer.
    capacity : int
        Own tokens a row can hold (its suffix plus the tokens it will generate).
    """

    def __init__(
        self,
        prefix: torch.Tensor | None,
        prefix_lengths: list[int],
        capacity: int,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype,
        device,
    ):
        rows = len(prefix_lengths)
        self.prefix = prefix
        self.P = 0 if prefix is None else int(prefix.shape[3])
        if any(p > self.P or p < 0 for p in prefix_lengths):
            raise ValueError(f"prefix lengths {prefix_lengths} exceed the prefix's {self.P} tokens")
        self.prefix_lengths = torch.tensor(prefix_lengths, dtype=torch.long, device=device)
        # Zeroed, not empty: masked slots still enter the matmuls (a masked score is
        # -inf, its weight 0), and uninitialized memory may hold NaN, which survives both.
        self.own_k = torch.zeros((num_layers, rows, kv_heads, capacity, head_dim), dtype=dtype, device=device)
        self.own_v = torch.zeros_like(self.own_k)
        self.offsets = torch.zeros(rows, dtype=torch.long, device=device)  # own tokens written per row
        self.rows, self.capacity = rows, capacity
        self._masks: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None = None
        self._q, self._width = 0, 0

    def position_ids(self, q: int) -> torch.Tensor:
        """Positions of the next ``q`` tokens of every row: ``p_b + offset_b + i``."""
        return (self.prefix_lengths + self.offsets)[:, None] + torch.arange(q, device=self.offsets.device)

    def begin(self, q: int) -> None:
        """Prepare a forward of ``q`` new tokens per row (call before each model call).

        Fixes the own-token width of this forward; the masks (built on its first layer,
        when the query's head grouping is known) are shared by all layers: prefix slot j
        is visible to row b iff ``j < p_b``; own slot j to query i of row b iff
        ``j <= offset_b + i``.
        """
        width = int(self.offsets.max()) + q
        if width > self.capacity:
            raise ValueError(f"a row would hold {width} own tokens, more than the capacity {self.capacity}")
        self._q, self._width, self._masks = q, width, None

    def _build_masks(self, g: int, dtype) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Additive masks in the folded query layout: rows ``(b, group, i)``; None where all is visible.

        Third: which rows see no prefix token at all (None if every row sees some).
        """
        q, W, dev, B = self._q, self._width, self.offsets.device, self.rows
        # The kernel wants a float mask of the query's dtype; finfo.min, not -inf, so that a
        # fully hidden row stays finite in the matmul form (its LSE is then set to -inf).
        neg = torch.finfo(dtype).min
        prefix_mask = blind = None
        if self.P and bool((self.prefix_lengths < self.P).any()):
            blind = (self.prefix_lengths == 0)[:, None, None] if bool((self.prefix_lengths == 0).any()) else None
            hide = torch.arange(self.P, device=dev)[None, :] >= self.prefix_lengths[:, None]  # [B, P]
            hide = hide.repeat_interleave(g * q, dim=0)  # [B*g*q, P]
            prefix_mask = torch.zeros(hide.shape, dtype=dtype, device=dev).masked_fill_(hide, neg)[None, None]
        limit = self.offsets[:, None] + torch.arange(q, device=dev)[None, :]  # [B, q]
        hide = torch.arange(W, device=dev)[None, None, :] > limit[:, :, None]  # [B, q, W]
        hide = hide[:, None].expand(B, g, q, W).reshape(B, 1, g * q, W)
        own_mask = torch.zeros(hide.shape, dtype=dtype, device=dev).masked_fill_(hide, neg)
        return prefix_mask, own_mask, blind

    def advance(self, counts: torch.Tensor | list[int]) -> None:
        """After a forward: row b keeps ``counts[b]`` of the ``q`` tokens it wrote (padding dropped)."""
        self.offsets += torch.as_tensor(counts, dtype=torch.long, device=self.offsets.device)

    def select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (finished rows leave the batch)."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.offsets.device)
        self.own_k, self.own_v = self.own_k[:, idx], self.own_v[:, idx]
        self.offsets, self.prefix_lengths = self.offsets[idx], self.prefix_lengths[idx]
        self.rows = len(keep)

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling) -> torch.Tensor:
        """One layer's attention for all rows; returns ``[B, q, heads, D]`` as transformers expects."""
        B, Hq, q, D = query.shape
        H = key.shape[1]
        g = Hq // H
        ok, ov = self.own_k[layer], self.own_v[layer]
        # Write the new tokens into each row's own slots [offset_b, offset_b + q).
        if q == 1:
            rows = torch.arange(B, device=query.device)
            ok[rows, :, self.offsets] = key[:, :, 0]
            ov[rows, :, self.offsets] = value[:, :, 0]
        else:
            if bool((self.offsets != self.offsets[0]).any()):
                raise ValueError("a multi-token forward needs every row at the same own offset")
            o = int(self.offsets[0])
            ok[:, :, o : o + q] = key
            ov[:, :, o : o + q] = value
        if self._masks is None:
            self._masks = self._build_masks(g, query.dtype)
        prefix_mask, own_mask, blind = self._masks
        W = self._width
        scale = scaling if scaling is not None else D**-0.5
        # Query heads of one group share a kv head (transformers' repeat_kv order): [B, H, g*q, D].
        qh = query.reshape(B, H, g * q, D)
        out, lse = _partial(qh, ok[:, :, :W], ov[:, :, :W], own_mask, scale)
        if self.P and self.prefix is not None:
            # Every row's queries as one batch against the one prefix copy: [1, H, B*g*q, D].
            qf = qh.transpose(0, 1).reshape(1, H, B * g * q, D)
            po, pl = _partial(qf, self.prefix[layer, 0][None], self.prefix[layer, 1][None], prefix_mask, scale)
            po = po.reshape(H, B, g * q, D).transpose(0, 1)
            pl = pl.reshape(H, B, g * q).transpose(0, 1)
            if blind is not None:
                # A row that sees no prefix token: the kernel returns output 0 with LSE 0; its true LSE is -inf.
                pl = pl.masked_fill(blind, float("-inf"))
            out = _merge(out, lse, po, pl)
        return out.to(query.dtype).reshape(B, Hq, q, D).transpose(1, 2)


def _partial(q, k, v, mask, scale, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over ``k, v`` and its log-sum-exp: ``([..., n, D], [..., n] float32)``.

    torch's public sdpa does not return the LSE the merge needs; its CPU flash kernel
    does, so on CPU that kernel is called directly. The matmul form elsewhere computes
    the same two values (no fused kernel with an LSE is public for every device).
    """
    if fused if fused is not None else q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v), lse


def _merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Combine two partial attentions over disjoint keys into the attention over their union (float32)."""
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top)[..., None], torch.exp(l2 - top)[..., None]
    return (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
