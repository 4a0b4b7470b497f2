"""The zict parts the tiered block store is composed of.

* :class:`ScoredLRU` - a ``zict.LRU`` whose victim is the lowest eviction score
  (``dask_kvstate.cost.eviction_score``: reuse, idleness, size) rather than the least
  recent key, and which never picks a key the store says must not move (in use).
* :class:`ScoredBuffer` - a ``zict.Buffer`` whose fast side is a ``ScoredLRU``, so the
  device -> host -> disk chain composes exactly as dask_cuda's DeviceHostFile does.
* :class:`DiskTier` - hash -> tensor on files: ``zict.File`` underneath, our checked raw
  format on top (never pickle), files 0600 in a 0700 directory, a byte budget, and
  ``DiskFullError`` when nothing more fits so the tier above keeps the block (zict's
  contract: a failing ``on_evict`` leaves the key where it was).
"""

from __future__ import annotations

import os
import threading
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
        ``(key, now) -> float``; lower goes first. ``now`` (``time.monotonic()``) is read
        once per choice, so every candidate is judged at the same instant.
    movable : callable
        ``key -> bool``; keys for which it is False are never chosen as victims. If no
        key is movable, eviction stops (``evict_until_below_target`` returns) and the
        tier stays over its budget until something is released.
    """

    def __init__(self, n, d, *, score: Callable, movable: Callable, **kwargs):
        super().__init__(n, d, **kwargs)
        self.score = score
        self.movable = movable

    def evict(self, key=nodefault):
        if key is nodefault:
            with self.lock:
                # Heavy keys (larger than the budget) go first, unless they are all pinned.
                candidates = [k for k in self.heavy if self.movable(k)] or [k for k in self.order if self.movable(k)]
                if not candidates:
                    raise KeyError("evict(): nothing movable")
                now = time.monotonic()
                key = min(candidates, key=lambda k: self.score(k, now))
        return super().evict(key)


class ScoredBuffer(zict.Buffer):
    """``zict.Buffer`` whose fast mapping evicts by score (see :class:`ScoredLRU`)."""

    def __init__(self, fast, slow, n, *, score: Callable, movable: Callable, **kwargs):
        super().__init__(fast, slow, n, weight=weight, **kwargs)
        # zict.Buffer builds a plain LRU; swap in the scored one, same wiring.
        self.fast = ScoredLRU(
            n,
            fast,
            weight=weight,
            score=score,
            movable=movable,
            on_evict=[self.fast_to_slow],
            on_cancel_evict=[self._cancel_evict],
        )


class DiskTier(MutableMapping):
    """Blocks on local disk: bytes keys (hashes) -> tensors, within ``capacity`` bytes.

    ``drop(key)`` is asked for room when a write would pass the budget: it deletes a
    block that may go (not referenced) and returns True, or returns False when
    nothing may; then the write raises :class:`DiskFullError`. So does a real
    ``ENOSPC``, after removing the partial file.
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
        self.lock = threading.RLock()

    def path(self, key: bytes) -> str:
        return os.path.join(self.directory, self.file.filenames[key.hex()])

    def __setitem__(self, key: bytes, value: torch.Tensor) -> None:
        size = nbytes(value)
        with self.lock:
            self.discard(key)
            self._make_room(size)
            frames = disk_format.encode(value)
            try:
                self.file[key.hex()] = frames
            except OSError as e:
                self._remove_orphans()
                raise DiskFullError(e.errno, f"cannot spill KV block to {self.directory}: {e.strerror}") from e
            os.chmod(self.path(key), 0o600)
            self.sizes[key] = size
            self.total += size

    def _make_room(self, size: int) -> None:
        for victim in self.victims():
            if self.total + size <= self.capacity:
                break
            if victim in self.sizes:
                del self[victim]
                self.on_drop(victim)
        if self.total + size > self.capacity:
            raise DiskFullError(
                f"disk tier full: {self.total + size} > {self.capacity} bytes (kvstate.worker.disk-bytes) "
                "and every block on it is still referenced"
            )

    def _remove_orphans(self) -> None:
        known = set(self.file.filenames.values())
        for name in os.listdir(self.directory):
            if name not in known:
                os.remove(os.path.join(self.directory, name))

    def __getitem__(self, key: bytes) -> torch.Tensor:
        """The block; ``CorruptBlockError`` for a damaged file, ``KeyError`` if absent."""
        with self.lock:
            if key not in self.sizes:
                raise KeyError(key)
            try:
                buf = self.file[key.hex()]
            except FileNotFoundError:
                self._forget(key)
                raise disk_format.CorruptBlockError("KV block file vanished") from None
        return disk_format.decode(buf)

    def __delitem__(self, key: bytes) -> None:
        with self.lock:
            if key not in self.sizes:
                raise KeyError(key)
            try:
                del self.file[key.hex()]
            except FileNotFoundError:
                self.file.filenames.pop(key.hex(), None)
            self.total -= self.sizes.pop(key)

    def _forget(self, key: bytes) -> None:
        self.file.filenames.pop(key.hex(), None)
        self.total -= self.sizes.pop(key, 0)

    def discard(self, key: bytes) -> None:
        if key in self.sizes:
            del self[key]

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self.sizes))

    def __len__(self) -> int:
        return len(self.sizes)
