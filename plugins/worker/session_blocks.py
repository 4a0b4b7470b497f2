"""Which KV blocks each session holds on one worker: the lifecycle worker half's record.

A block belongs to a session when one of the session's tasks computed, pulled,
recomputed or read it on this worker (or returned a ref over it). Blocks are shared by
content, so one block may belong to several sessions; a per-block count of its sessions
tells the session's *own* blocks (those no other session holds: they move and go with
it) in time linear in the session's blocks, not in every session's.

Not locked: the event loop owns it. The periodic byte report reads a :meth:`~SessionBlocks.snapshot`
in a thread (:func:`tier_bytes`), so the loop only copies containers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class SessionBlocks:
    """Per session, the hashes of the blocks it holds here; per hash, how many sessions hold it.

    Examples
    --------
    >>> s = SessionBlocks()
    >>> s.add("a", [b"x", b"y"]), s.add("b", [b"y"]), s.add("a", [b"x"])
    (True, True, False)
    >>> sorted(s.own("a")), s.own("b")
    ([b'x'], [])
    >>> sorted(s.pop("a")), s.own("b"), "a" in s
    ([b'x', b'y'], [b'y'], False)
    """

    def __init__(self):
        self.by_session: dict[str, set[bytes]] = {}
        self.count: Counter[bytes] = Counter()
        #: Bumped on every change, so a report knows when nothing changed.
        self.version = 0

    def add(self, sid: str, hashes: Iterable[bytes]) -> bool:
        """Add ``hashes`` to ``sid``'s blocks; whether any was new."""
        held = self.by_session.setdefault(sid, set())
        new = [h for h in dict.fromkeys(hashes) if h not in held]
        if new:
            held.update(new)
            self.count.update(new)
            self.version += 1
        return bool(new)

    def pop(self, sid: str) -> set[bytes]:
        """Forget ``sid``; its blocks (empty for an unknown session)."""
        hashes = self.by_session.pop(sid, set())
        for h in hashes:
            self.count[h] -= 1
            if self.count[h] <= 0:
                del self.count[h]
        self.version += 1
        return hashes

    def own(self, sid: str) -> list[bytes]:
        """``sid``'s blocks no other session holds."""
        return [h for h in self.by_session.get(sid, ()) if self.count[h] == 1]

    def held_by_any(self, h: bytes) -> bool:
        return self.count.get(h, 0) > 0

    def snapshot(self) -> tuple[dict[str, list[bytes]], dict[bytes, int]]:
        """Copies of the record for a reader in another thread (container copies only)."""
        return {sid: list(hs) for sid, hs in self.by_session.items()}, dict(self.count)

    def __contains__(self, sid: object) -> bool:
        return sid in self.by_session

    def __len__(self) -> int:
        return len(self.by_session)


def tier_bytes(store, by_session: dict[str, list[bytes]], count: dict[bytes, int]) -> dict[str, dict[str, int]]:
    """Per session, the bytes of its own blocks (a :meth:`SessionBlocks.snapshot`) in each tier of ``store``.

    Linear in the sessions' blocks; reads the store without its lock (a block changing
    tier meanwhile shows in the next report).
    """
    out = {}
    for sid, hashes in by_session.items():
        per = {"device": 0, "host": 0, "disk": 0}
        for h in hashes:
            if count.get(h) == 1:
                tier = store.where(h)
                if tier is not None:
                    per[tier] += store.size_of(h)
        out[sid] = per
    return out
