"""Measurements a worker makes on purpose, not as a side effect of work.

:func:`probe` seeds the prefill cost model when the worker plugin starts, so the
transfer-or-recompute rule has numbers before the first real prefill.
:func:`measure_fill` times filling a state's blocks by one option, and
:func:`measure_rule` by the rule's own choice (with its probe and cut-off), for the
benchmarks that check the rule against both options' real times.
"""

from __future__ import annotations

import time

import torch

from dask_kvstate.plugins.worker.engine import KVEngine
from dask_kvstate.plugins.worker.resolve import Resolver
from dask_kvstate.state import KVStateRef


def probe(kv: KVEngine, sizes=(32, 256)) -> None:
    """Time a few prefills of ``kv``'s model to seed its prefill cost model."""
    vocab = kv.backend.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (max(sizes),), generator=g).tolist()
    kv.backend.prefill(ids[: min(sizes)])  # warm-up: first calls pay one-off kernel setup
    for n in sizes:
        t0 = time.perf_counter()
        kv.backend.prefill(ids[:n])
        kv.prefill_meter.add(n, 0, time.perf_counter() - t0)


def measure_fill(resolver: Resolver, ref: KVStateRef, action: str) -> float:
    """Seconds to fill ``ref``'s blocks here by ``action`` ("pull" or "recompute"), from
    none held locally; the blocks are dropped again after."""
    kv = resolver.kv
    if action not in ("pull", "recompute"):
        raise ValueError(f"action must be 'pull' or 'recompute', got {action!r}")
    if ref.placement.worker in (None, kv.address):
        raise ValueError("measure_fill needs a state held by another worker")
    ids = kv.backend.tokenize(ref.text)
    kv.store.discard(ref.blocks)
    t0 = time.perf_counter()
    if action == "pull":
        got = resolver.pull(ref.placement.worker, list(ref.blocks), resolver.block_shapes(ref))
        if len(got) != len(ref.blocks):
            raise RuntimeError(f"pull from {ref.placement.worker} returned {len(got)} of {len(ref.blocks)} blocks")
    else:
        resolver.recompute(ids, ref.blocks, [None] * len(ref.blocks), 0, namespace=ref.namespace)
    seconds = time.perf_counter() - t0
    kv.store.discard(ref.blocks)
    return seconds


def measure_rule(resolver: Resolver, ref: KVStateRef, forget: bool = False) -> dict:
    """Fill ``ref``'s blocks here as a task would (the rule, its probe, its cut-off), from
    none held: the decision carried out, with its ``seconds``; the blocks are dropped after.

    With ``forget``, what was measured of the holder's link is dropped first, so the
    rule meets the link as a fresh worker would.
    """
    kv = resolver.kv
    holder = ref.placement.worker
    if holder in (None, kv.address):
        raise ValueError("measure_rule needs a state held by another worker")
    if forget:
        kv.links.forget(holder)
    ids = kv.backend.tokenize(ref.text)
    kv.store.discard(ref.blocks)
    _, decision = resolver.fill_decided(ref, ids)
    kv.store.discard(ref.blocks)
    assert decision is not None, "a state held elsewhere, none of it here: fill decides"
    return {k: v for k, v in decision.wire().items() if k != "key"}
