"""The zict parts the tiered block store is composed of.

* :class:`ScoredLRU` - a ``zict.LRU`` whose victims are the lowest eviction scores
  (``dask_kvstate.cost.eviction_score``: reuse, idleness, size) rather than the least
  recent keys, and which never picks a key the store says must not move (in use). Each
  memory tier (device, host) is one: its weights, budget (``n``) and order are zict's.
* :class:`DiskTier` - hash -> tensor on files: ``zict.File`` underneath, our checked raw
  format on top (never pickle), files 0600 in a 0700 directory, a byte budget, and
  ``DiskFullError`` when nothing more fits so the tier above keeps the block.

The store moves blocks between them itself (``plugins/worker/moves.py``), not through
``zict.Buffer``: a Buffer moves a block inside the call that overflowed the tier, so on
whatever thread made that call, and the store must never write to disk on the event loop.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, MutableMapping

import torch
import zict
from zict.common import nodefault

from dask_kvstate.blocks import nbytes
from dask_kvstate.plugins.worker import disk_format


def weight(key, value) -> int:
    return nbytes(value)


class DiskFullError(OSError):
    """The disk tier's budget (or the disk itself) has no room for another block."""


class ScoredLRU(zict.LRU):
    """``zict.LRU`` evicting the lowest-scored movable key instead of the oldest.

    Parameters
    ----------
    score : callable
        ``(key, now) -> comparable`` (a float, or a tuple whose first item puts a class of
        keys after all others); lower goes first. ``now`` (``time.monotonic()``) is read
        once per choice, so every candidate is judged at the same instant.
    movable : callable
        ``key -> bool``; keys for which it is False are never chosen as victims. If no
        key is movable, eviction stops (``evict_until_below_target`` returns) and the
        tier stays over its budget until something is released.

    Examples
    --------
    >>> lru = ScoredLRU(10, {}, weight=lambda k, v: v, score=lambda k, now: -k, movable=lambda k: k != 3)
    >>> for k in (1, 2, 3):
    ...     lru.set_noevict(k, 4)
    >>> lru.victims()            # highest key scores lowest here; 3 is in use
    [2, 1]
    """

    def __init__(self, n, d, *, score: Callable, movable: Callable, **kwargs):
        kwargs.setdefault("weight", weight)
        super().__init__(n, d, **kwargs)
        self.score = score
        self.movable = movable

    def victims(self) -> list:
        """The movable keys in eviction order: heavy ones (larger than the budget) first,
        unless they are all pinned, then the lowest score first (ties: oldest first)."""
        with self.lock:
            candidates = [k for k in self.heavy if self.movable(k)] or [k for k in self.order if self.movable(k)]
        now = time.monotonic()
        return sorted(candidates, key=lambda k: self.score(k, now))

    def over(self) -> bool:
        """Whether the tier is over its budget and some key could move to bring it back."""
        return self.total_weight > self.n and any(self.movable(k) for k in self.order)

    def evict(self, key=nodefault):
        if key is nodefault:
            victims = self.victims()
            if not victims:
                raise KeyError("evict(): nothing movable")
            key = victims[0]
        return super().evict(key)


class DiskTier(MutableMapping):
    """Blocks on local disk: bytes keys (hashes) -> tensors, within ``capacity`` bytes.

    When a write would pass the budget, ``victims()`` names blocks that may go (not
    referenced), lowest score first; they are dropped (``on_drop(key)``) until the
    block fits, else the write raises :class:`DiskFullError`. So does a real ``ENOSPC``,
    after removing the partial file.

    A write happens in steps, so that the block store can do the bookkeeping under its
    lock and the file I/O outside it: :meth:`reserve` (room, counted against the budget
    at once), :meth:`write` (I/O), then :meth:`commit`, or :meth:`unreserve` and
    :meth:`abandon`. Reads and
    deletes go by the file's name, taken under the lock (:meth:`name_of`, :meth:`forget`),
    read or removed after it (:meth:`read`, :meth:`remove`): ``zict.File`` gives every
    write a name of its own, so a file removed or rewritten meanwhile is never mistaken
    for another. The mapping methods chain the steps, for use by one thread.

    Not locked itself: the store calls the bookkeeping steps under its own lock. The one
    exception is :meth:`write`, which ``zict.File`` registers under zict's lock, outside
    the store's; that is safe because the store writes a key only on its mover thread and
    only while the key is on no disk record, so no other step touches it until its commit.
    """

    def __init__(
        self,
        directory: str,
        capacity: int,
        *,
        victims: Callable[[], Iterator[bytes]] = lambda: iter(()),
        on_drop: Callable[[bytes], None] = lambda key: None,
    ):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        for name in os.listdir(directory):  # stale files of a previous worker: not ours to trust
            os.remove(os.path.join(directory, name))
        self.directory = directory
        self.capacity = int(capacity)
        self.victims = victims
        self.on_drop = on_drop
        self.file = zict.File(directory)
        self.sizes: dict[bytes, int] = {}  # tensor bytes per key (what budgets count)
        self.total = 0
        self.reserved = 0  # bytes of writes under way, counted against the budget

    def path(self, key: bytes) -> str:
        return os.path.join(self.directory, self.file.filenames[key.hex()])

    # -- the steps (bookkeeping: under the store's lock; I/O: outside it) ----------------
    def reserve(self, size: int) -> list[str]:
        """Room for ``size`` more bytes (bookkeeping): the files of the blocks dropped for
        it, to :meth:`remove`. :class:`DiskFullError`, dropping nothing, if even dropping
        every unreferenced block would not make the room."""
        need = self.total + self.reserved + size - self.capacity
        chosen: list[bytes] = []
        if need > 0:  # victims() sorts the whole tier: only when needed
            for victim in self.victims():
                if need <= 0:
                    break
                if victim in self.sizes:
                    chosen.append(victim)
                    need -= self.sizes[victim]
        if need > 0:
            raise DiskFullError(
                f"disk tier full: {self.total + self.reserved + size} > {self.capacity} bytes "
                "(kvstate.worker.disk-bytes) and every block on it is still referenced"
            )
        doomed = []
        for victim in chosen:
            doomed.append(self.forget(victim))
            self.on_drop(victim)
        self.reserved += size
        return doomed

    def unreserve(self, size: int) -> None:
        self.reserved -= size

    def write(self, key: bytes, value: torch.Tensor) -> str:
        """Write ``value``'s file (I/O: encode, checksum, write, chmod); its name."""
        try:
            self.file[key.hex()] = disk_format.encode(value)
            name = self.file.filenames[key.hex()]
        except OSError as e:
            self._remove_orphans()
            raise DiskFullError(e.errno, f"cannot spill KV block to {self.directory}: {e.strerror}") from e
        os.chmod(os.path.join(self.directory, name), 0o600)
        return name

    def commit(self, key: bytes, size: int) -> None:
        """The written block is on the disk tier (bookkeeping)."""
        self.reserved -= size
        self.sizes[key] = size
        self.total += size

    def abandon(self, key: bytes, name: str) -> str:
        """Give up a written, uncommitted file (bookkeeping); its path, to :meth:`remove`."""
        if self.file.filenames.get(key.hex()) == name:
            del self.file.filenames[key.hex()]
        return os.path.join(self.directory, name)

    def name_of(self, key: bytes) -> str | None:
        """The file name of a stored ``key`` (bookkeeping), or None."""
        return self.file.filenames.get(key.hex()) if key in self.sizes else None

    def read(self, name: str) -> torch.Tensor:
        """The block in file ``name`` (I/O); ``CorruptBlockError`` if damaged,
        ``FileNotFoundError`` if it is gone."""
        with open(os.path.join(self.directory, name), "rb") as fh:
            buf = bytearray(os.fstat(fh.fileno()).st_size)
            fh.readinto(buf)
        return disk_format.decode(buf)

    def forget(self, key: bytes) -> str:
        """Take ``key`` off the tier (bookkeeping), written or not; the path to :meth:`remove`."""
        name = self.file.filenames.pop(key.hex(), None)
        self.total -= self.sizes.pop(key, 0)
        return os.path.join(self.directory, name) if name else ""

    @staticmethod
    def remove(path: str) -> None:
        """Delete a file taken off the tier (I/O); one already gone is no error."""
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def _remove_orphans(self) -> None:
        known = set(self.file.filenames.values())
        for name in os.listdir(self.directory):
            if name not in known:
                self.remove(os.path.join(self.directory, name))

    # -- MutableMapping ----------------------------------------------------------------
    def __setitem__(self, key: bytes, value: torch.Tensor) -> None:
        size = nbytes(value)
        self.discard(key)
        for path in self.reserve(size):
            self.remove(path)
        try:
            self.write(key, value)
        except BaseException:
            self.unreserve(size)
            raise
        self.commit(key, size)

    def __getitem__(self, key: bytes) -> torch.Tensor:
        """The block; ``CorruptBlockError`` for a damaged file, ``KeyError`` if absent."""
        name = self.name_of(key)
        if name is None:
            raise KeyError(key)
        try:
            return self.read(name)
        except FileNotFoundError:
            self.forget(key)
            raise disk_format.CorruptBlockError("KV block file vanished") from None

    def __delitem__(self, key: bytes) -> None:
        if key not in self.sizes:
            raise KeyError(key)
        self.remove(self.forget(key))

    def discard(self, key: bytes) -> None:
        if key in self.sizes:
            del self[key]

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self.sizes))

    def __len__(self) -> int:
        return len(self.sizes)
