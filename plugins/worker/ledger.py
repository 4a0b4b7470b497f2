"""What a block store knows of its blocks besides their bytes, and the eviction policy on it.

Per block: its size, how often and when it was last used (:class:`BlockMeta`), and who
protects it (:class:`Owners`: pins by running tasks, holds by refs), and whether a task
is expected to read it soon (a prefetch's mark). The :class:`BlockLedger` turns that into
the choices a tier makes: the eviction score (``dask_kvstate.cost.eviction_score``: reuse,
idleness, size, expected blocks last), which blocks may move down a tier (not pinned) and
which may be dropped (neither pinned nor held).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from dask_kvstate.cost import eviction_score


@dataclass(slots=True)
class BlockMeta:
    """Use of one stored block, as the eviction score reads it."""

    hits: int
    #: ``time.monotonic()`` of the last put, get or promotion
    last_used: float
    nbytes: int


#: What the score assumes of a block the ledger has no record of.
UNKNOWN = BlockMeta(hits=0, last_used=0.0, nbytes=1)


class Owners:
    """Per-owner sets of hashes, with a per-hash count (pins or holds).

    Examples
    --------
    >>> pins = Owners()
    >>> pins.set("task-a", [b"x", b"y"]); pins.set("task-b", [b"y"])
    >>> b"y" in pins, pins.clear("task-a"), b"x" in pins, b"y" in pins
    (True, (b'x', b'y'), False, True)
    """

    def __init__(self):
        self.by_owner: dict[Hashable, tuple[bytes, ...]] = {}
        self.count: Counter[bytes] = Counter()

    def set(self, owner: Hashable, hashes: Iterable[bytes]) -> None:
        self.clear(owner)
        hs = tuple(dict.fromkeys(hashes))
        self.by_owner[owner] = hs
        self.count.update(hs)

    def clear(self, owner: Hashable) -> tuple[bytes, ...]:
        hs = self.by_owner.pop(owner, ())
        self.count.subtract(hs)
        for h in hs:
            if self.count[h] <= 0:
                del self.count[h]
        return hs

    def __contains__(self, h: object) -> bool:
        return isinstance(h, bytes) and self.count[h] > 0


class BlockLedger:
    """Block records, protection and the eviction policy of one store.

    Not locked: the store calls it under its own lock.

    Examples
    --------
    >>> ledger = BlockLedger(half_life_s=60.0)
    >>> ledger.touch(b"a", hit=False, size=40); ledger.touch(b"b", hit=False, size=40)
    >>> ledger.pins.set("task", [b"a"])
    >>> ledger.movable(b"a"), ledger.droppable([b"a", b"b"]), ledger.size_of(b"a")
    (False, [b'b'], 40)
    """

    def __init__(self, half_life_s: float):
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s!r}")
        self.half_life_s = float(half_life_s)
        self.meta: dict[bytes, BlockMeta] = {}
        self.pins = Owners()  # in use: do not move
        self.holds = Owners()  # referenced: do not drop
        #: block -> ``time.monotonic()`` deadline: a prefetch brought it up for a task due by then
        self.expected: dict[bytes, float] = {}

    def touch(self, h: bytes, hit: bool, size: int | None = None) -> None:
        """Record a use of ``h`` (a first one creates its record with ``size``)."""
        m = self.meta.get(h)
        if m is None:
            m = self.meta[h] = BlockMeta(0, 0.0, size or 1)
        m.hits += hit
        m.last_used = time.monotonic()

    def expect(self, hashes: Iterable[bytes], until: float) -> None:
        """Evict ``hashes`` last until ``until`` (``time.monotonic()``) or until a task reads them.

        A prefetch brings a session's blocks up for a task predicted soon. By their own
        record those blocks are the coldest in the tier (read once, long ago), so without
        the mark the next overflow, often the running task's own new blocks, sends them
        straight back down and the task reads them from below after all.
        """
        for h in hashes:
            self.expected[h] = max(until, self.expected.get(h, 0.0))

    def unexpect(self, hashes: Iterable[bytes]) -> None:
        """The reads came (a task pinned them) or will not (an offload was asked): no mark."""
        for h in hashes:
            self.expected.pop(h, None)

    def forget(self, h: bytes) -> None:
        self.meta.pop(h, None)
        self.expected.pop(h, None)

    def size_of(self, h: bytes) -> int:
        m = self.meta.get(h)
        return m.nbytes if m is not None else 0

    def score(self, h: bytes, now: float) -> tuple[bool, float]:
        """Eviction score of ``h`` at ``now``, expected blocks above all others; the lowest goes first."""
        m = self.meta.get(h, UNKNOWN)
        expected = self.expected.get(h, 0.0) > now
        return expected, eviction_score(m.hits, now - m.last_used, m.nbytes, self.half_life_s)

    def movable(self, h: bytes) -> bool:
        """Whether ``h`` may move to another tier (no running task pins it)."""
        return h not in self.pins

    def droppable(self, hashes: Iterable[bytes]) -> list[bytes]:
        """Those of ``hashes`` no ref holds and no running task pins."""
        return [h for h in hashes if h not in self.holds and h not in self.pins]

    def lowest(self, hashes: Iterable[bytes]) -> list[bytes]:
        """The droppable ones of ``hashes``, lowest score first."""
        now = time.monotonic()
        return sorted(self.droppable(hashes), key=lambda h: self.score(h, now))
