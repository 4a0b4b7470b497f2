"""Generation for sibling rows that share one prefix state: batched, with the prefix read in place.

Forked branches resume from one state, each with its own suffix. All rows run
together: one forward prefills every row's suffix (right-padded to the longest), then
one forward per step decodes every row. A decode step of a small model on CPU is
bound by reading the weights, so B rows cost far less than B steps (SmolLM2 on two
cores: 69 ms at batch 1, 345 ms at batch 16).

The rows' attention over the shared prefix goes through
:class:`~dask_kvstate.backends.cascade.SharedPrefixKV`: the prefix's KV is read where
it lies, once per step for all rows, and never copied per row; each row's own tokens
go to a preallocated buffer. So the KV a batch holds is one prefix plus B short
suffixes (not B prefixes), and no step copies the cache (``DynamicCache`` grows by
``torch.cat``). A single resume is the same code with one row.

Correctness: row b sees the first ``keep_b`` prefix tokens and its own tokens
causally, at its true positions, so each row computes the same function as text
replay of its prompt. Floating point may round differently in the last bits (two
partial attentions merged by their log-sum-exp, batched matmuls), which could flip a
greedy argmax on a near-tie; outputs are
checked against unbatched text-replay-equivalent generation token for token in the
tests (tiny-llama, and SmolLM2 on the benchmark prompts in a slow test).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from dask_kvstate.backends import compat, layout, paged_rows
from dask_kvstate.backends.base import GenerationResult, Row
from dask_kvstate.backends.cascade import CascadeUnsupported, SharedPrefixKV, serving, unsupported_layout
from dask_kvstate.backends.decoding import generator, pick_token
from dask_kvstate.backends.paged_rows import PagedRows
from dask_kvstate.generation import Sampling

__all__ = ["Row", "generate_batch", "kv_bytes"]  # Row lives in base (the interface); callers find it here too


def _row_sampling(sampling: Sampling, row: Row) -> Sampling:
    return sampling if row.seed is None else replace(sampling, seed=row.seed)


def _capacity(rows: list[Row], max_new_tokens: int) -> int:
    """Own tokens each row's buffer holds: the longest suffix plus the tokens to generate."""
    return max((len(r.ids) - r.keep for r in rows), default=0) + max(max_new_tokens, 1)


def kv_bytes(backend, rows: list[Row], max_new_tokens: int) -> int:
    """KV bytes :func:`generate_batch` allocates for ``rows``: their own tokens (the prefix is
    borrowed), or, paged, the pages (the prefix copied into them)."""
    capacity = _capacity(rows, max_new_tokens)
    if _paged(backend, rows):
        return paged_rows.kv_bytes(backend.cpu_attention, backend.num_layers, [r.keep for r in rows], capacity)
    return len(rows) * capacity * backend.kv_bytes_per_token


@torch.inference_mode()
def generate_batch(
    backend,
    rows: list[Row],
    prefix: torch.Tensor | None,
    sampling: Sampling,
    *,
    started: float | None = None,
    on_prefill: Callable[[Any], None] | None = None,
    on_sequence: Callable[[Any, list[int]], None] | None = None,
) -> list[GenerationResult]:
    """Generate for every row over the shared ``prefix`` KV ([L, 2, H, P, D]); one result per row.

    Each row's tokens equal text replay of ``row.ids`` (greedy, or sampling with the row's
    seed). ``ttft`` is from ``started`` (default: now) to the row's first token; all rows'
    suffixes are prefilled by one forward, so they share it. ``on_prefill`` (one row only)
    gets the prompt's KV once its first token is picked, as a
    :class:`~dask_kvstate.backends.layout.PromptKV` (or the fallback's cache), which the
    backend's ``kv_to_store`` reads; ``on_sequence`` (one row only) gets it once decoding is
    done, holding the generated tokens but the last too, with the ids it covers. Raises
    ValueError for an empty row or a ``keep`` the prefix can't cover.
    """
    t0 = time.perf_counter() if started is None else started
    hooks = {"on_prefill": on_prefill, "on_sequence": on_sequence}
    if (on_prefill is not None or on_sequence is not None) and len(rows) != 1:
        raise ValueError(f"on_prefill and on_sequence take the KV of one prompt, not of {len(rows)} rows")
    for n, row in enumerate(rows):
        if not row.ids:
            raise ValueError(f"row {n} has an empty prompt: give at least one token of text")
        if not 0 <= row.keep < len(row.ids):
            raise ValueError(
                f"row {n} keeps {row.keep} prefix tokens of a {len(row.ids)}-token prompt: "
                "at least its last token must be computed"
            )
    why = "attention not routable" if not backend.cascade else unsupported_layout(backend.layout.kinds)
    if why is None:
        try:
            return _cascade(backend, rows, prefix, sampling, t0, **hooks)
        except CascadeUnsupported as e:
            why = str(e)
    # The model's own attention, one stock resume per row; counted, so that a model the
    # fused path does not serve shows up in ``kvs.stats`` rather than silently slower.
    backend.cascade_fallbacks[why] += 1
    return [
        backend.generate_in_cache(
            r.ids,
            prefix[:, :, :, : r.keep] if prefix is not None and r.keep else None,
            _row_sampling(sampling, r),
            started=t0,
            **hooks,
        )
        for r in rows
    ]


def _paged(backend, rows: list[Row]) -> bool:
    """Whether the rows go to vLLM's CPU kernel over shared pages (:mod:`.paged_rows`): a batch
    (never one prompt, so no hook), where the backend loaded the kernel, of a model with no
    sliding window."""
    return (
        getattr(backend, "cpu_attention", None) is not None
        and backend.cascade  # else the rows run one by one in the model's own attention
        and len(rows) >= paged_rows.MIN_ROWS
        and all(w is None for w in backend.layout.windows)
    )


def _cascade(backend, rows: list[Row], prefix, sampling: Sampling, t0: float, **hooks) -> list[GenerationResult]:
    if prefix is not None:
        prefix = prefix.to(backend.device, non_blocking=True)
    keep, capacity = [r.keep for r in rows], _capacity(rows, sampling.max_new_tokens)
    kv: SharedPrefixKV | PagedRows
    if _paged(backend, rows):
        kv = PagedRows(backend.cpu_attention, prefix, keep, capacity, num_layers=backend.num_layers)
        return _run(backend, kv, rows, prefix, sampling, t0)
    kv = SharedPrefixKV(
        prefix,
        keep,
        capacity,
        num_layers=backend.num_layers,
        kv_heads=backend.kv_heads,
        head_dim=backend.head_dim,
        dtype=backend.dtype,
        device=backend.device,
        windows=backend.layout.windows,
    )
    return _run(backend, kv, rows, prefix, sampling, t0, **hooks)


def _run(
    backend,
    kv: SharedPrefixKV | PagedRows,
    rows: list[Row],
    prefix,
    sampling: Sampling,
    t0: float,
    on_prefill: Callable[[Any], None] | None = None,
    on_sequence: Callable[[Any, list[int]], None] | None = None,
) -> list[GenerationResult]:
    device = backend.device
    own = [len(r.ids) - r.keep for r in rows]
    gens = [generator(device, sampling.temperature, _row_sampling(sampling, r).seed) for r in rows]
    outs: list[list[int]] = [[] for _ in rows]

    # Prefill: every row's own tokens in one forward, right-padded (a pad sits after a
    # row's real tokens, so causal masking keeps it out of the real ones).
    p0 = time.perf_counter()
    x = torch.zeros((len(rows), max(own)), dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        x[b, : own[b]] = torch.tensor(r.ids[r.keep :], dtype=torch.long)
    kv.begin(x.shape[1])
    # The whole model, so the first token gets its logit post-processing (final softcap,
    # logit scales) as every later one does; logits only at each row's last real token.
    last = torch.tensor(own, device=device)[:, None] - 1
    with serving(kv):
        res = backend.model(
            input_ids=x,
            position_ids=kv.position_ids(x.shape[1]),
            **compat.cache_kwargs(backend.model, None),
            use_cache=False,
            logits_to_keep=last,
        )
    kv.check_attended()
    logits = compat.rows_logits(res.logits).float()
    kv.advance(own)
    live = []
    if sampling.max_new_tokens > 0:
        for b in range(len(rows)):
            outs[b].append(pick_token(logits[b], sampling.temperature, sampling.top_p, gens[b]))
            if outs[b][-1] not in backend.eos_ids and sampling.max_new_tokens > 1:
                live.append(b)
    first = time.perf_counter()
    prefill_s = first - p0
    if on_prefill is not None:  # after the first token, so its copy counts as decode time
        assert isinstance(kv, SharedPrefixKV), "paged rows are batches, never one prompt"
        on_prefill(layout.PromptKV(prefix, rows[0].keep, kv.own_k[:, 0], kv.own_v[:, 0], own[0]))
    if live and len(live) < len(rows):
        kv.select(live)  # rows done at their first token (EOS) leave before the first decode step

    # Decode: one forward per step for the rows still running.
    while live:
        x = torch.tensor([[outs[b][-1]] for b in live], dtype=torch.long, device=device)
        kv.begin(1)
        with serving(kv):
            res = backend.model(
                input_ids=x,
                position_ids=kv.position_ids(1),
                **compat.cache_kwargs(backend.model, None),
                use_cache=False,
            )
        kv.check_attended()
        logits = res.logits[:, -1].float()
        kv.advance([1] * len(live))
        keep = []
        for i, b in enumerate(live):
            outs[b].append(pick_token(logits[i], sampling.temperature, sampling.top_p, gens[b]))
            if outs[b][-1] not in backend.eos_ids and len(outs[b]) < sampling.max_new_tokens:
                keep.append(i)
        if len(keep) < len(live):
            # Finished rows leave the batch, so later steps cost only what is still running.
            if keep:
                kv.select(keep)
            live = [live[i] for i in keep]
    decode_s = time.perf_counter() - first
    if on_sequence is not None:  # one row, never dropped from the batch: its buffers hold every token
        assert isinstance(kv, SharedPrefixKV), "paged rows are batches, never one prompt"
        computed = own[0] + max(len(outs[0]) - 1, 0)  # the last token's KV is not computed
        on_sequence(
            layout.PromptKV(prefix, rows[0].keep, kv.own_k[:, 0], kv.own_v[:, 0], computed),
            list(rows[0].ids) + outs[0][:-1],
        )
    return [
        GenerationResult(
            token_ids=outs[b],
            ttft=(first - t0) if outs[b] else 0.0,
            prefill_s=prefill_s / len(rows),
            decode_s=decode_s,
            prefill_tokens=own[b],
            reused_tokens=r.keep,
        )
        for b, r in enumerate(rows)
    ]
