"""Decoding many rows over one shared prefix without copying the prefix (cascade attention).

Why: siblings forked from one state share its KV. transformers' ``DynamicCache`` wants
one ``[batch, heads, tokens, dim]`` tensor per layer and grows it with ``torch.cat``,
so batching B siblings means B copies of the prefix, and every decode step copies all
of them again (at L = 4,096 on SmolLM2 that is ~1.5 GB per step for 8 rows). Serving
engines avoid this with cascade / radix attention (FlashInfer's cascade kernels,
SGLang's radix attention, vLLM's shared blocks): attention over the shared prefix is
computed once against the single prefix copy, attention over each row's own tokens
against that row's buffer, and the two are combined in one softmax.

How, within transformers: the model keeps its attention implementation, but under a
name of ours (:data:`ATTN_NAME`) whose function dispatches: a forward called with the
keyword ``kvstate_cascade=<SharedPrefixKV>`` (transformers passes unknown keywords down
to the attention function) runs :meth:`SharedPrefixKV.attend`; any other call goes to
the implementation the model had (sdpa or eager), with the same arguments, so text
replay and the block-store paths compute exactly what they did. Such a forward runs
with ``cache=None``: the rows' KV lives in the :class:`SharedPrefixKV`, which writes
each layer's new keys and values into preallocated per-row buffers (no ``torch.cat``
per step) and never copies the prefix.

Two kernels: a decode step (one query per row) uses the split softmax above, so the
prefix is read in place, once for all rows. The suffixes' prefill (many queries per
row, once per batch) runs torch's fused sdpa over the prefix expanded per row for that
one forward: there the split softmax's score tensors (B x heads x q x P) made it twice
as slow as the fused kernel.

Exactness: the result is the same softmax(QK^T)V over the same keys as sdpa over the
concatenated cache, masked per row (row b sees the first ``p_b`` prefix tokens and its
own tokens causally). The arithmetic is split differently, so the last bits of a float
may differ from sdpa's; greedy outputs are checked against text replay token for token
in the tests.
"""
from __future__ import annotations

import torch

ATTN_NAME = "kvstate_cascade"

_previous: dict[str, object] = {}


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

    def __init__(self, prefix: torch.Tensor | None, prefix_lengths: list[int], capacity: int, *,
                 num_layers: int, kv_heads: int, head_dim: int, dtype, device):  # fmt: skip
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
        self._see = self._mask = None
        self._width = 0

    def position_ids(self, q: int) -> torch.Tensor:
        """Positions of the next ``q`` tokens of every row: ``p_b + offset_b + i``."""
        return (self.prefix_lengths + self.offsets)[:, None] + torch.arange(q, device=self.offsets.device)

    def begin(self, q: int) -> None:
        """Prepare a forward of ``q`` new tokens per row (call before each model call).

        Builds the mask shared by all layers: prefix slot j is visible to row b iff
        ``j < p_b``; own slot j to query i of row b iff ``j <= offset_b + i``. Boolean for
        sdpa (a multi-token forward), additive for the split softmax (a decode step).
        """
        width = int(self.offsets.max()) + q
        if width > self.capacity:
            raise ValueError(f"a row would hold {width} own tokens, more than the capacity {self.capacity}")
        dev = self.offsets.device
        j_p = torch.arange(self.P, device=dev)
        see_p = (j_p[None, :] < self.prefix_lengths[:, None])[:, None, :].expand(self.rows, q, self.P)
        j_o = torch.arange(width, device=dev)
        limit = self.offsets[:, None] + torch.arange(q, device=dev)[None, :]  # [B, q]
        see_o = j_o[None, None, :] <= limit[:, :, None]
        see = torch.cat((see_p, see_o), dim=-1)  # [B, q, P + width]
        self._width = width
        if q > 1:
            self._see, self._mask = see[:, None], None  # [B, 1, q, P + width] for sdpa (True = attend)
            return
        mask = torch.zeros(see.shape, dtype=torch.float32, device=dev).masked_fill_(~see, float("-inf"))
        self._see, self._mask = None, mask[:, None, None]  # [B, 1, 1, q, P + width]: over kv heads and groups

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
        W = self._width
        scale = scaling if scaling is not None else D**-0.5
        if q > 1:
            return self._attend_fused(layer, query, ok[:, :, :W], ov[:, :, :W], scale)
        # Query heads of one group share a kv head (transformers' repeat_kv order): [B, H, g*q, D].
        qh = query.reshape(B, H, g * q, D)
        parts = []
        if self.P:
            kp = self.prefix[layer, 0]  # [H, P, D], read in place for all rows at once
            # [H, B*g*q, D] @ [H, D, P]: one matmul per kv head over every row's queries.
            sp = torch.matmul(qh.transpose(0, 1).reshape(H, B * g * q, D), kp.transpose(1, 2))
            parts.append(sp.reshape(H, B, g * q, self.P).transpose(0, 1))
        parts.append(torch.matmul(qh, ok[:, :, :W].transpose(2, 3)))  # [B, H, g*q, W]
        scores = torch.cat(parts, dim=-1).mul_(scale).reshape(B, H, g, q, self.P + W)
        probs = torch.softmax(scores.float() + self._mask, dim=-1).to(query.dtype).reshape(B, H, g * q, self.P + W)
        out = torch.matmul(probs[..., self.P :], ov[:, :, :W])  # [B, H, g*q, D]
        if self.P:
            vp = self.prefix[layer, 1]  # [H, P, D]
            pp = probs[..., : self.P].transpose(0, 1).reshape(H, B * g * q, self.P)
            out = out + torch.matmul(pp, vp).reshape(H, B, g * q, D).transpose(0, 1)
        return out.reshape(B, Hq, q, D).transpose(1, 2)

    def _attend_fused(self, layer: int, query, own_k, own_v, scale) -> torch.Tensor:
        """A multi-token forward (the suffixes' prefill): torch's fused sdpa over prefix + own tokens.

        Here every row has many queries, so the split softmax above would build score
        tensors of B x heads x q x P floats (~43 MB a layer at B = 8, q = 36, P = 4,096)
        and run unfused softmax, mask and reshapes over them: measured twice as slow as
        sdpa's fused kernel, which wants each row's keys in one tensor. So the prefix is
        expanded per row for this one forward (a transient copy of B x P per layer),
        never for a decode step.
        """
        B = query.shape[0]
        if self.P:
            kp, vp = self.prefix[layer, 0], self.prefix[layer, 1]  # [H, P, D]
            own_k = torch.cat((kp[None].expand(B, *kp.shape), own_k), dim=2)
            own_v = torch.cat((vp[None].expand(B, *vp.shape), own_v), dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(query, own_k, own_v, attn_mask=self._see, scale=scale,
                                                               enable_gqa=True)  # fmt: skip
        return out.transpose(1, 2)
