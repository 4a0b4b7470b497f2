"""A worker's KV block store: content-addressed blocks, pinned by the refs that use them.

This is the single in-memory tier. The interface (``put``/``get``/``pin``/``unpin``/
``discard``/``stats``) is what the worker plugin and the runtime use, so the tiered
device -> host -> disk store can replace :class:`MemoryBlockStore` without touching them.

Pins are counted per *owner* (a Dask key whose value holds a ref, or a running task)
and per hash, independent of whether the block is present: a block pulled in later for
a ref this worker already holds is protected at once. Unpinned blocks stay as a
prefix cache (what vLLM keeps as free-but-cached blocks) until the byte budget needs
their room; then the least recently used go first. Hand-written rather than
``zict.LRU`` because zict has no notion of pinned entries that must never be evicted.
"""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable

import torch


class MemoryBlockStore:
    """Blocks in worker memory under a byte budget.

    Parameters
    ----------
    capacity : int
        Bytes of unpinned blocks kept before least-recently-used ones are dropped.
        Pinned blocks are never dropped, even over the budget.

    Examples
    --------
    >>> import torch
    >>> store = MemoryBlockStore(capacity=100)
    >>> store.put(b"a", torch.zeros(10))          # 40 bytes each
    >>> store.pin("ref-1", [b"a"])
    >>> store.put(b"b", torch.zeros(10))
    >>> store.put(b"c", torch.zeros(10))          # 120 bytes: the oldest unpinned goes
    >>> sorted(store)
    [b'a', b'c']
    >>> store.unpin("ref-1")                       # now b"a" may go too
    >>> store.put(b"d", torch.zeros(10))
    >>> sorted(store), store.stats()["evictions"]
    ([b'c', b'd'], 2)
    """

    tier = "device"

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 bytes, got {capacity!r}")
        self.capacity = int(capacity)
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # LRU order
        self._pins: Counter[bytes] = Counter()
        self._owners: dict[Hashable, tuple[bytes, ...]] = {}
        self._lock = threading.RLock()
        self.nbytes = 0
        self.counters: Counter[str] = Counter()

    # -- mapping-like ----------------------------------------------------------------
    def __contains__(self, h: object) -> bool:
        return h in self._blocks

    def __iter__(self):
        return iter(list(self._blocks))

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, h: bytes, tensor: torch.Tensor) -> None:
        """Store a block (a no-op when the same hash is already stored: content-addressed)."""
        with self._lock:
            if h in self._blocks:
                self._blocks.move_to_end(h)
                return
            self._blocks[h] = tensor
            self.nbytes += _nbytes(tensor)
            self.counters["puts"] += 1
            self._shrink()

    def get(self, h: bytes) -> torch.Tensor | None:
        """The block's tensor, or None; counts a hit or a miss."""
        with self._lock:
            t = self._blocks.get(h)
            if t is None:
                self.counters["misses"] += 1
                return None
            self._blocks.move_to_end(h)
            self.counters["hits"] += 1
            return t

    def peek(self, h: bytes) -> torch.Tensor | None:
        """Like :meth:`get` without counting or touching recency (serving peers, stats)."""
        return self._blocks.get(h)

    # -- pins ----------------------------------------------------------------------
    def pin(self, owner: Hashable, hashes: Iterable[bytes]) -> None:
        """Protect ``hashes`` for as long as ``owner`` holds them (re-pinning replaces)."""
        with self._lock:
            self.unpin(owner)
            hs = tuple(dict.fromkeys(hashes))
            self._owners[owner] = hs
            self._pins.update(hs)

    def unpin(self, owner: Hashable) -> None:
        """Release ``owner``'s pins (a no-op for an unknown owner); may evict."""
        with self._lock:
            hs = self._owners.pop(owner, None)
            if not hs:
                return
            self._pins.subtract(hs)
            for h in hs:
                if self._pins[h] <= 0:
                    del self._pins[h]
            self._shrink()

    def owners(self) -> list[Hashable]:
        return list(self._owners)

    def is_pinned(self, h: bytes) -> bool:
        return self._pins.get(h, 0) > 0

    def discard(self, hashes: Iterable[bytes]) -> int:
        """Drop the unpinned ones of ``hashes`` now; returns the bytes freed."""
        freed = 0
        with self._lock:
            for h in hashes:
                if h in self._blocks and not self.is_pinned(h):
                    freed += self._drop(h)
        return freed

    # -- accounting ----------------------------------------------------------------
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(_nbytes(t) for h, t in self._blocks.items() if self.is_pinned(h))

    def stats(self) -> dict:
        with self._lock:
            return {
                "tier": self.tier,
                "blocks": len(self._blocks),
                "bytes": self.nbytes,
                "pinned_bytes": self.pinned_bytes(),
                "capacity": self.capacity,
                "hits": self.counters["hits"],
                "misses": self.counters["misses"],
                "evictions": self.counters["evictions"],
            }

    def _shrink(self) -> None:
        if self.nbytes <= self.capacity:
            return
        for h in list(self._blocks):  # oldest first
            if self.nbytes <= self.capacity:
                break
            if not self.is_pinned(h):
                self._drop(h)
                self.counters["evictions"] += 1

    def _drop(self, h: bytes) -> int:
        n = _nbytes(self._blocks.pop(h))
        self.nbytes -= n
        return n


def _nbytes(t: torch.Tensor) -> int:
    return t.nelement() * t.element_size()
