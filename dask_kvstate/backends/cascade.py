"""Decoding many rows over one shared prefix without copying the prefix (cascade attention).

Why: siblings forked from one state share its KV. transformers' ``DynamicCache`` wants
one ``[batch, heads, tokens, dim]`` tensor per layer and grows it with ``torch.cat``,
so batching B siblings means B copies of the prefix, and every decode step copies all
of them again (at L = 4,096 on SmolLM2 that is ~1.5 GB per step for 8 rows). Serving
engines avoid this with cascade / radix attention (FlashInfer's cascade kernels,
SGLang's radix attention, vLLM's shared blocks): attention over the shared prefix is
computed once against the single prefix copy, attention over each row's own tokens
against that row's buffer, and the two are merged exactly by their log-sum-exp.

How, within transformers: :mod:`.attention` routes a forward run inside :func:`serving`
(a context variable, so per thread) to :meth:`SharedPrefixKV.attend`, and every forward
inside :func:`serving` checks that each layer's attention did come through the cascade
(:meth:`SharedPrefixKV.check_attended`), else it raises :class:`CascadeUnsupported`
rather than return what the model did without it. Such a forward runs with no cache
(:mod:`~dask_kvstate.backends.compat` names the keyword): the rows' KV lives in the
:class:`SharedPrefixKV`, which writes each layer's new keys and values into preallocated
per-row buffers (no ``torch.cat`` per step) and never copies the prefix.

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

What the model's own attention does, the cascade does too: per-layer sliding windows
(each layer's window from :mod:`~dask_kvstate.backends.layout`, also hiding prefix
tokens that slid out, and reading only the part of the prefix some row can still
see), attention logit softcapping (Gemma2 on eager; computed in the matmul form, which
the fused kernel lacks; sdpa applies none), attention sinks (``s_aux``, gpt-oss: one more term in the
softmax's denominator, applied to the merged output), and the module's ``scaling``.
The model's attention mask is not used: the masks here encode causality, windows and
each row's prefix length, which is all a text-only causal LM's mask holds. A feature
outside that list (chunked attention, dropout, a window the module names that the
layout does not) raises :class:`CascadeUnsupported`; the caller then runs the
model's own attention per row for that call and counts it.

Keys and values of different head sizes (MLA) come stored at the wider size, the
narrower zero-padded (:mod:`~dask_kvstate.backends.layout`); the new tokens' keys and values
are padded the same way (and the queries with the keys), so the fused kernel, which
wants one head size, serves them too: zero columns add nothing to ``QK^T``, and the
padded value columns of the output, which are zeros, are cut off.

Exactness: the result is the same softmax(QK^T)V over the same keys as sdpa over the
concatenated cache, masked per row (row b sees the first ``p_b`` prefix tokens and its
own tokens causally). The arithmetic is split differently, so the last bits of a float
may differ from sdpa's; greedy outputs are checked against text replay token for token
in the tests.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F


class CascadeUnsupported(Exception):
    """The model asked the cascade for an attention feature it does not compute."""


class RowsAttention(Protocol):
    """What the forwards inside :func:`serving` attend through: :class:`SharedPrefixKV`, or
    :class:`~.paged_rows.PagedRows` (vLLM's CPU kernel over shared pages)."""

    def attend(
        self, layer: int, query, key, value, scaling, *, softcap=None, sinks=None, window=None
    ) -> torch.Tensor: ...


_Rows = TypeVar("_Rows", bound=RowsAttention)

#: The rows a forward in this thread serves through the cascade (:func:`serving`), or None.
_SERVING: contextvars.ContextVar[RowsAttention | None] = contextvars.ContextVar("kvstate_cascade", default=None)


@contextlib.contextmanager
def serving(kv: _Rows) -> Iterator[_Rows]:
    """Route the attention of forwards run inside (in this thread) to ``kv``."""
    token = _SERVING.set(kv)
    try:
        yield kv
    finally:
        _SERVING.reset(token)


def unsupported_layout(kinds: Sequence[str]) -> str | None:
    """Why the cascade can't serve a model with these layer kinds, or None."""
    odd = sorted({k for k in kinds if k not in ("full_attention", "sliding_attention")})
    return f"{', '.join(odd)} layers" if odd else None


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
    windows : sequence of int or None, one per layer
        Each layer's sliding window (None: full attention); default all full.
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
        windows: Sequence[int | None] | None = None,
    ):
        rows = len(prefix_lengths)
        self.prefix = prefix
        self.P = 0 if prefix is None else int(prefix.shape[3])
        if any(p > self.P or p < 0 for p in prefix_lengths):
            raise ValueError(f"prefix lengths {prefix_lengths} exceed the prefix's {self.P} tokens")
        self.windows = tuple(windows) if windows is not None else (None,) * num_layers
        if len(self.windows) != num_layers:
            raise ValueError(f"{len(self.windows)} windows for {num_layers} layers")
        self.prefix_lengths = torch.tensor(prefix_lengths, dtype=torch.long, device=device)
        # Zeroed, not empty: masked slots still enter the matmuls (a masked score is
        # -inf, its weight 0), and uninitialized memory may hold NaN, which survives both.
        self.own_k = torch.zeros((num_layers, rows, kv_heads, capacity, head_dim), dtype=dtype, device=device)
        self.own_v = torch.zeros_like(self.own_k)
        self.offsets = torch.zeros(rows, dtype=torch.long, device=device)  # own tokens written per row
        self.rows, self.capacity = rows, capacity
        self._masks: dict[tuple[int | None, int, bool], _Masks] = {}
        self._q, self._width = 0, 0
        self._attended: set[int] = set()  # layers whose attention this forward served

    def position_ids(self, q: int) -> torch.Tensor:
        """Positions of the next ``q`` tokens of every row: ``p_b + offset_b + i``."""
        return (self.prefix_lengths + self.offsets)[:, None] + torch.arange(q, device=self.offsets.device)

    def begin(self, q: int) -> None:
        """Prepare a forward of ``q`` new tokens per row (call before each model call).

        Fixes the own-token width of this forward; the masks (built on the first layer of
        each window, when the query's head grouping is known) are shared by the layers
        with that window.
        """
        width = int(self.offsets.max()) + q
        if width > self.capacity:
            raise ValueError(f"a row would hold {width} own tokens, more than the capacity {self.capacity}")
        self._q, self._width, self._masks = q, width, {}
        self._attended = set()

    def check_attended(self) -> None:
        """After a forward: raise :class:`CascadeUnsupported` unless every layer's attention came here.

        A layer whose attention ran without the cascade saw no prefix (the forward has no
        cache), so its output is not the row's: never returned.
        """
        missing = sorted(set(range(len(self.windows))) - self._attended)
        if missing:
            raise CascadeUnsupported(f"the attention of layers {missing} did not go through the cascade")

    def _build_masks(self, g: int, dtype, window: int | None, own: bool = True) -> _Masks:
        """Additive masks in the folded query layout: rows ``(b, group, i)``; None where all is
        visible, and for the own slots when not ``own`` (the caller attends to them causally).

        Query i of row b sits at position ``pos = p_b + offset_b + i``. Prefix slot j is
        visible to it iff ``j < p_b`` and ``pos - j < window``; own slot j iff
        ``j <= offset_b + i`` and ``offset_b + i - j < window`` (transformers' sliding
        mask: ``kv_idx > q_idx - window``). Only prefix slots from ``lo``, the first one
        any query can see, up to ``hi``, the longest ``p_b``, are read at all.
        """
        q, W, dev, B = self._q, self._width, self.offsets.device, self.rows
        # The kernel wants a float mask of the query's dtype; finfo.min, not -inf, so that a
        # fully hidden row stays finite in the matmul form (its LSE is then set to -inf).
        neg = torch.finfo(dtype).min
        steps = torch.arange(q, device=dev)[None, :]
        own_pos = self.offsets[:, None] + steps  # [B, q]: own index of each query
        own_mask = None
        if own:
            hide = torch.arange(W, device=dev)[None, None, :] > own_pos[:, :, None]  # [B, q, W]
            if window is not None:
                hide |= torch.arange(W, device=dev)[None, None, :] <= own_pos[:, :, None] - window
            hide = hide[:, None].expand(B, g, q, W).reshape(B, 1, g * q, W)
            own_mask = torch.zeros(hide.shape, dtype=dtype, device=dev).masked_fill_(hide, neg)
        # Slots from hi on are no row's (each keeps its first p_b): not read, so siblings that
        # all keep the same p_b attend with no prefix mask at all.
        hi = int(self.prefix_lengths.max()) if self.P else 0
        lo, prefix_mask, blind = 0, None, None
        if hi:
            pos = self.prefix_lengths[:, None] + own_pos  # [B, q]: absolute positions
            if window is not None:
                lo = min(max(int(pos.min()) - window + 1, 0), hi)
            slots = torch.arange(lo, hi, device=dev)[None, None, :]  # [1, 1, hi - lo]
            hide = slots >= self.prefix_lengths[:, None, None]
            if window is not None:
                hide = hide | (slots <= pos[:, :, None] - window)
            hide = hide.expand(B, q, hi - lo)
            if bool(hide.any()):
                seen = ~hide.all(dim=-1)  # [B, q]: queries that see some prefix slot
                if not bool(seen.all()):
                    blind = (~seen)[:, None].expand(B, g, q).reshape(B, 1, g * q)
                hide = hide[:, None].expand(B, g, q, hi - lo).reshape(B * g * q, hi - lo)
                prefix_mask = torch.zeros(hide.shape, dtype=dtype, device=dev).masked_fill_(hide, neg)[None, None]
        return _Masks(lo, hi, prefix_mask, own_mask, blind)

    def advance(self, counts: torch.Tensor | list[int]) -> None:
        """After a forward: row b keeps ``counts[b]`` of the ``q`` tokens it wrote (padding dropped)."""
        self.offsets += torch.as_tensor(counts, dtype=torch.long, device=self.offsets.device)

    def select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (finished rows leave the batch)."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.offsets.device)
        self.own_k, self.own_v = self.own_k[:, idx], self.own_v[:, idx]
        self.offsets, self.prefix_lengths = self.offsets[idx], self.prefix_lengths[idx]
        self.rows = len(keep)

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling,
        *,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """One layer's attention for all rows; returns ``[B, q, heads, D]`` as transformers expects.

        ``window`` is what the module says its sliding window is (checked against the
        layout's), ``softcap`` its attention logit cap, ``sinks`` its per-head sink logits.
        """
        if window is not None and window != self.windows[layer]:
            raise CascadeUnsupported(
                f"layer {layer} attends with window {window}, the cache layout says {self.windows[layer]}"
            )
        window = self.windows[layer]
        self._attended.add(layer)
        B, Hq, q, query_dim = query.shape
        value_dim, D = value.shape[-1], self.own_k.shape[-1]
        if max(key.shape[-1], value_dim) != D:
            raise ValueError(f"layer {layer} attends with K {key.shape[-1]}, V {value_dim} wide; the buffers are {D}")
        # Stored KV is as wide as the wider of K and V (layout.kv_of): pad the new tokens alike.
        query, key, value = (t if t.shape[-1] == D else F.pad(t, (0, D - t.shape[-1])) for t in (query, key, value))
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
        # The rows' first forward: its own part is plain causal attention over the q new
        # tokens (a row's pads come after its tokens). The kernel skips the hidden half
        # when told is_causal; given the mask it reads every slot (2.2x at 4,074 tokens).
        causal = q > 1 and int(self.offsets[0]) == 0 and window is None and not softcap and query.device.type == "cpu"
        masks = self._masks.get((window, g, causal))
        if masks is None:
            masks = self._masks[(window, g, causal)] = self._build_masks(g, query.dtype, window, own=not causal)
        W = self._width
        scale = scaling if scaling is not None else query_dim**-0.5
        # The fused kernel has no logit softcap; the matmul form applies it where eager does.
        fused = False if softcap else None
        # Query heads of one group share a kv head (transformers' repeat_kv order): [B, H, g*q, D].
        qh = query.reshape(B, H, g * q, D)
        if causal:
            out, lse = _causal(query, key, value, g, scale)
            out, lse = out.reshape(B, H, g * q, D), lse.reshape(B, H, g * q)
        else:
            out, lse = _partial(qh, ok[:, :, :W], ov[:, :, :W], masks.own, scale, fused, softcap)
        if self.prefix is not None and masks.lo < masks.hi:
            # Every row's queries as one batch against the one prefix copy: [1, H, B*g*q, D].
            qf = qh.transpose(0, 1).reshape(1, H, B * g * q, D)
            pk = self.prefix[layer, 0, :, masks.lo : masks.hi][None]
            pv = self.prefix[layer, 1, :, masks.lo : masks.hi][None]
            po, pl = _partial(qf, pk, pv, masks.prefix, scale, fused, softcap)
            po = po.reshape(H, B, g * q, D).transpose(0, 1)
            pl = pl.reshape(H, B, g * q).transpose(0, 1)
            if masks.blind is not None:
                # A query that sees no prefix token: the kernel's output is arbitrary; its true LSE is -inf.
                pl = pl.masked_fill(masks.blind, float("-inf"))
            out, lse = _merge(out, lse, po, pl)
        if sinks is not None:
            # A sink adds e^s to the softmax's denominator and nothing to its numerator.
            s = sinks.float().reshape(1, H, g, 1).expand(1, H, g, q).reshape(1, H, g * q)
            out = out.float() * torch.sigmoid(lse - s)[..., None]
        # Contiguous, as transformers' own attention functions return it: callers .view() it.
        return out.to(query.dtype).reshape(B, Hq, q, D)[..., :value_dim].transpose(1, 2).contiguous()


@dataclass
class _Masks:
    """One forward's masks for the layers of one window (see ``_build_masks``)."""

    lo: int  # first prefix slot read
    hi: int  # one past the last (the longest p_b)
    prefix: torch.Tensor | None
    own: torch.Tensor | None
    blind: torch.Tensor | None


def _partial(q, k, v, mask, scale, fused: bool | None = None, softcap: float | None = None):
    """Attention of ``q`` over ``k, v`` and its log-sum-exp: ``([..., n, D], [..., n] float32)``.

    torch's public sdpa does not return the LSE the merge needs; its CPU flash kernel
    does, so on CPU that kernel is called directly. The matmul form elsewhere (and for a
    logit softcap, ``tanh(s / cap) * cap`` before the mask, as eager attention does)
    computes the same two values.
    """
    if softcap is None and (fused if fused is not None else q.device.type == "cpu"):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v), lse


def _causal(query, key, value, g: int, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``query`` (``[B, H * g, q, D]``) over ``key, value`` (``[B, H, q, D]``)
    and its log-sum-exp, with CPU's flash kernel (kv heads repeated for their ``g`` query heads,
    transformers' ``repeat_kv`` order)."""
    if g > 1:
        key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(query, key, value, is_causal=True, scale=scale)
    return out, lse


def _merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint keys into the attention over their union
    (float32), with its log-sum-exp."""
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top)[..., None], torch.exp(l2 - top)[..., None]
    total = w1 + w2
    return (o1.float() * w1 + o2.float() * w2) / total, top + torch.log(total[..., 0])
