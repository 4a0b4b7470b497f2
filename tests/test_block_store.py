"""The in-memory block store, step by step: where each block is after each call."""
from __future__ import annotations

import pytest
import torch

from dask_kvstate.plugins.block_store import MemoryBlockStore


def block(n_floats: int = 10) -> torch.Tensor:
    return torch.zeros(n_floats)  # 4 bytes per float


def test_put_is_content_addressed():
    store = MemoryBlockStore(capacity=1000)
    store.put(b"a", block())
    store.put(b"a", block())
    assert len(store) == 1 and store.nbytes == 40


def test_hits_misses_and_peek():
    store = MemoryBlockStore(capacity=1000)
    store.put(b"a", block())
    assert store.get(b"a") is not None and store.get(b"b") is None
    assert store.peek(b"a") is not None
    s = store.stats()
    assert (s["hits"], s["misses"], s["blocks"], s["bytes"]) == (1, 1, 1, 40)


def test_budget_evicts_least_recently_used_unpinned():
    store = MemoryBlockStore(capacity=100)
    store.put(b"a", block())
    store.put(b"b", block())
    store.get(b"a")  # b is now the least recent
    store.put(b"c", block())
    assert sorted(store) == [b"a", b"c"]
    assert store.stats()["evictions"] == 1


def test_pins_hold_blocks_over_budget_until_released():
    store = MemoryBlockStore(capacity=50)
    store.pin("ref-1", [b"a", b"b"])  # pins may precede the blocks (pulled later)
    store.put(b"a", block())
    store.put(b"b", block())
    assert sorted(store) == [b"a", b"b"] and store.pinned_bytes() == 80
    store.pin("ref-2", [b"b"])
    store.unpin("ref-1")
    assert sorted(store) == [b"b"]  # a dropped as soon as nothing pins it
    store.unpin("ref-2")
    assert sorted(store) == [b"b"]  # within budget: kept as prefix cache


def test_discard_frees_only_unpinned_blocks():
    store = MemoryBlockStore(capacity=1000)
    for h in (b"a", b"b"):
        store.put(h, block())
    store.pin("fork", [b"a"])
    assert store.discard([b"a", b"b", b"zz"]) == 40
    assert sorted(store) == [b"a"]


def test_negative_capacity_rejected():
    with pytest.raises(ValueError, match="capacity"):
        MemoryBlockStore(capacity=-1)
