"""A worker's KV block store: device -> host -> disk tiers composed from zict parts.

The tiers (``plugins/worker/tiers.py``)::

    device = ScoredLRU(n=device-bytes)                 # CUDA tensors, or CPU ones
    host   = ScoredLRU(n=host-bytes)                   # pinned memory on CUDA
    disk   = DiskTier(<worker local dir>/kvstate-blocks, disk-bytes) # raw bytes + checksum

A block lives in exactly one tier (content-addressed: forks share it, whatever tier).
New and read blocks enter the device tier; when a tier passes its budget the block
with the lowest eviction score (reuse, idleness, size) moves one tier down.

Blocks move down on the store's one mover thread (``plugins/worker/moves.py``), never on
the caller's: the event loop (the plugin's task-end ``unpin``, stats, holds) only asks
for a rebalance. The lock is held for bookkeeping only, never across a copy or a file.
Budgets: a tier is over its budget only by pinned blocks, and by blocks whose move the
mover has not reached yet. That backlog is bounded on the producer's side: a thread
that puts or reads a block (a task) and so finds a tier over budget waits for the
mover's pass before it goes on, so no producer adds to a backlog; the event loop never
waits, and the mover, when it reads or offloads, rebalances inline.

Two kinds of protection, both counted per owner and per hash, independent of where
(or whether) the block is:

* ``pin(owner, hashes)`` - *in use* by a running task: the block does not move.
* ``hold(owner, hashes)`` - *referenced* by a ref this worker holds: the block may
  spill down, but is never dropped. Unreferenced blocks are a prefix cache and are
  dropped when the disk tier needs room (or by ``discard``).

A damaged or vanished spill file is a miss (counted as a checksum failure), never an
exception: the caller pulls the block from a peer or recomputes it. A full disk keeps
blocks in the tier above; if that tier is over budget too, unreferenced blocks are
dropped to be recomputed later.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
import weakref
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, Sequence
from concurrent.futures import Future

import torch

from dask_kvstate.blocks import nbytes
from dask_kvstate.plugins.worker import moves
from dask_kvstate.plugins.worker.ledger import BlockLedger
from dask_kvstate.plugins.worker.moves import Mover, on_event_loop
from dask_kvstate.plugins.worker.store_stats import store_stats
from dask_kvstate.plugins.worker.tiers import DiskTier, ScoredLRU
from dask_kvstate.state import TIERS

logger = logging.getLogger("dask_kvstate")


class TieredBlockStore:
    """KV blocks of one worker, in three tiers with byte budgets.

    Parameters
    ----------
    directory : str, optional
        Folder for the disk tier (made 0700; its old contents are removed). Without one
        the store makes its own temporary folder and removes it when closed, collected, or at exit.
    device_bytes, host_bytes, disk_bytes : int
        Budgets of the tiers. A memory tier may pass its budget by blocks that are
        pinned in use, and until the mover has moved what passed it (module docstring).
    half_life_s : float
        Idle half-life in the eviction score.
    device : str or torch.device, optional
        Where device-tier tensors live; CUDA when available, else CPU.

    Examples
    --------
    >>> import tempfile, torch
    >>> store = TieredBlockStore(tempfile.mkdtemp(), device_bytes=100, host_bytes=100, disk_bytes=10**6)
    >>> for h in (b"a", b"b", b"c"):
    ...     store.put(h, torch.zeros(10))           # 40 bytes each; off the event loop, put waits for the spill
    >>> store.where(b"a"), store.where(b"c")       # the device tier holds 100 bytes
    ('host', 'device')
    >>> store.get(b"a") is not None, store.where(b"a")
    (True, 'device')
    >>> store.close()
    """

    tier = "device"

    def __init__(
        self,
        directory: str | None = None,
        *,
        device_bytes: int,
        host_bytes: int,
        disk_bytes: int,
        half_life_s: float = 60.0,
        device: str | torch.device | None = None,
    ):
        for name, v in (("device_bytes", device_bytes), ("host_bytes", host_bytes), ("disk_bytes", disk_bytes)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative number of bytes, got {v!r}")
        self.ledger = BlockLedger(half_life_s)
        self.pins, self.holds = self.ledger.pins, self.ledger.holds
        self.device_type = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.directory = directory or tempfile.mkdtemp(prefix="kvstate-blocks-")
        # A folder it made is the store's to remove: at close, or when the store is collected
        # unclosed (a test's, a bench's) or at the interpreter's exit; a folder it was given (the
        # worker's) is its owner's.
        self._remove_own_folder = (
            None if directory else weakref.finalize(self, shutil.rmtree, self.directory, ignore_errors=True)
        )
        self.counters: dict[str, Counter[str]] = {t: Counter() for t in TIERS}
        self.counters["store"] = Counter()
        self.device_peak = 0
        #: Bumped whenever a block enters or leaves the store (not when it changes tier).
        self.version = 0
        #: Guards every tier's bookkeeping and the ledger; never held across I/O (moves.py).
        self.lock = threading.RLock()
        #: The one thread every move down (and every prefetch) runs on.
        self.mover = Mover(lambda: moves.drain(self))
        #: The tiers as mappings, so ``h in store.host`` says where a block lives.
        self.disk = DiskTier(self.directory, disk_bytes, victims=self._disk_victims, on_drop=self.dropped)
        self.host = ScoredLRU(host_bytes, {}, score=self.ledger.score, movable=self.ledger.movable)
        self.device = ScoredLRU(device_bytes, {}, score=self.ledger.score, movable=self.ledger.movable)

    # -- bookkeeping ---------------------------------------------------------------
    def _disk_victims(self) -> Iterator[bytes]:
        """Unreferenced blocks on disk, lowest score first (asked when the disk is full)."""
        return iter(self.ledger.lowest(self.disk))

    def dropped(self, h: bytes) -> None:
        """Bookkeeping for a block deleted from every tier to make room."""
        self.ledger.forget(h)
        self.counters["store"]["dropped"] += 1
        self.version += 1

    def size_of(self, h: bytes) -> int:
        """Bytes of block ``h`` (0 if not stored). Locked: the serve path asks from the event loop."""
        with self.lock:
            return self.ledger.size_of(h)

    def _settle(self) -> None:
        """After a block entered a memory tier or was unpinned: bring the tiers back under budget.

        The mover does it. Backpressure on the producer: a caller off the event loop
        waits for that pass (so a task never adds to a backlog), the event loop never
        waits (the tier stays over budget until the mover gets there), and the mover
        itself rebalances inline.
        """
        with self.lock:
            need = self.device.over() or self.host.over()
        if need:
            if self.mover.here():
                moves.drain(self)
            elif not on_event_loop():
                moves.wait(self.mover.rebalance())
            else:
                self.mover.rebalance()
        self.device_peak = max(self.device_peak, int(self.device.total_weight))

    def remove_files(self, paths: Sequence[str | None]) -> None:
        """Delete files taken off the disk tier: on the mover when asked from the event loop."""
        files = [p for p in paths if p is not None]
        if files and on_event_loop():
            self.mover.submit(lambda: [self.disk.remove(p) for p in files])
        else:
            for p in files:
                self.disk.remove(p)

    # -- mapping-like ----------------------------------------------------------------
    def where(self, h: bytes) -> str | None:
        """The tier holding ``h``, or None."""
        with self.lock:
            if h in self.device:
                return "device"
            if h in self.host:
                return "host"
            if h in self.disk:
                return "disk"
            return None

    def __contains__(self, h: object) -> bool:
        return isinstance(h, bytes) and self.where(h) is not None

    def __iter__(self):
        with self.lock:
            return iter([*self.device, *self.host, *self.disk])

    def __len__(self) -> int:
        with self.lock:
            return len(self.device) + len(self.host) + len(self.disk)

    @property
    def nbytes(self) -> int:
        with self.lock:
            return int(self.device.total_weight + self.host.total_weight + self.disk.total)

    def put(self, h: bytes, tensor: torch.Tensor) -> None:
        """Store a block in the device tier (a no-op if already stored anywhere).

        Off the event loop it returns once the tiers are back under budget (see :meth:`_settle`).
        """
        with self.lock:
            if h in self:  # content-addressed: a fork's blocks are re-put often; no copy for those
                return
        tensor = moves.to_device(self, tensor)  # a host-to-device copy on CUDA: outside the lock
        with self.lock:
            if h in self:
                return
            self.ledger.touch(h, hit=False, size=nbytes(tensor))
            self.counters["store"]["puts"] += 1
            self.version += 1
            self.device.set_noevict(h, tensor)
        self._settle()

    def get(self, h: bytes) -> torch.Tensor | None:
        """The block, brought up to the device tier; None on a miss (counted).

        A spilled block is read on the calling thread. Never raises for a damaged spill
        file or a full disk.
        """
        value = moves.fetch(self, h, up=True, count=True)
        if value is not None:
            self._settle()
        return value

    def adopt(self, hashes: Sequence[bytes], joined: torch.Tensor, block_tokens: int) -> int:
        """Make blocks on the device tier views of ``joined``, their concatenation; returns how many.

        A resume reads a state's KV as one tensor, so the first resume on a worker joins
        the blocks (a copy); adopting that copy as the blocks' storage drops the
        originals, so the worker holds the state once, and later resumes join to a
        view (``blocks.join_blocks``). The bytes are the same, so weights don't change.
        A block that spills later is written from its view; the joined tensor's memory
        goes when its last block has left the device tier. A block being moved down
        meanwhile stays (the move sees another value and gives up).
        """
        done = 0
        with self.lock:
            for i, h in enumerate(hashes):
                old = self.device.d.get(h)
                view = joined[:, :, :, i * block_tokens : (i + 1) * block_tokens]
                if old is None or old.shape != view.shape or old.dtype != view.dtype or old.device != view.device:
                    continue
                self.device.d[h] = view
                done += 1
        return done

    def peek(self, h: bytes) -> torch.Tensor | None:
        """The block without counting or moving it between tiers (serving peers). Never raises."""
        return moves.fetch(self, h, up=False, count=False)

    def peek_memory(self, h: bytes) -> torch.Tensor | None:
        """The block if it sits in a memory tier (never reads disk), else None; like :meth:`peek`."""
        with self.lock:
            v = self.device.d.get(h)
            return v if v is not None else self.host.d.get(h)

    # -- protection ----------------------------------------------------------------
    def pin(self, owner: Hashable, hashes: Iterable[bytes]) -> None:
        """Keep ``hashes`` where they are while ``owner`` (a running task) uses them."""
        with self.lock:
            self.pins.set(owner, hashes)
            self.ledger.unexpect(self.pins.by_owner[owner])

    def pin_more(self, owner: Hashable, hashes: Iterable[bytes]) -> None:
        """Add ``hashes`` to what ``owner`` pins (:meth:`pin` replaces them)."""
        with self.lock:
            self.pins.set(owner, (*self.pins.by_owner.get(owner, ()), *hashes))
            self.ledger.unexpect(self.pins.by_owner[owner])

    def expect(self, hashes: Iterable[bytes], within_s: float) -> None:
        """A task will read ``hashes`` within ``within_s`` seconds: evict them last until
        then, or until a task pins them (:meth:`BlockLedger.expect`)."""
        with self.lock:
            self.ledger.expect(hashes, time.monotonic() + within_s)

    def unexpect(self, hashes: Iterable[bytes]) -> None:
        with self.lock:
            self.ledger.unexpect(hashes)

    def unpin(self, owner: Hashable) -> None:
        """Let ``owner``'s blocks move again. From the event loop (the plugin's transition
        hook) this only asks the mover to rebalance; it never waits for it."""
        with self.lock:
            cleared = self.pins.clear(owner)
        if cleared:
            self._settle()

    def pinned_by(self, owner: Hashable) -> bool:
        """Whether ``owner`` pins any block. No lock: one dict lookup, atomic under the GIL,
        so the worker plugin can skip :meth:`unpin` for the many tasks that pin nothing."""
        return owner in self.pins.by_owner

    def hold(self, owner: Hashable, hashes: Iterable[bytes]) -> None:
        """Never drop ``hashes`` while ``owner`` (a key holding a ref) exists."""
        with self.lock:
            self.holds.set(owner, hashes)

    def release(self, owner: Hashable) -> None:
        with self.lock:
            self.holds.clear(owner)

    def discard(self, hashes: Iterable[bytes]) -> int:
        """Drop the unreferenced, unpinned ones of ``hashes`` from every tier; returns bytes freed.

        A block being moved meanwhile is dropped all the same: its move gives up and
        deletes the file it wrote. Files are deleted after the lock is let go (on the
        mover, when called from the event loop).
        """
        freed, stale = 0, []
        with self.lock:
            for h in self.ledger.droppable(hashes):
                tier = self.where(h)
                if tier is None:  # not stored here
                    continue
                size = self.ledger.size_of(h)
                if tier == "disk":
                    stale.append(self.disk.forget(h))
                else:
                    del (self.device if tier == "device" else self.host)[h]
                self.ledger.forget(h)
                self.version += 1
                freed += size
        self.remove_files(stale)
        return freed

    # -- moving on request ---------------------------------------------------------
    def prefetch(self, hashes: Iterable[bytes]) -> Future:
        """Bring ``hashes`` up to the device tier on the mover; the future gives how many moved."""
        return self.mover.submit(self.promote, list(hashes))

    def promote(self, hashes: list[bytes]) -> int:
        """Bring ``hashes`` up to the device tier now, reading on this thread; returns how many moved.

        Never raises.
        """
        moved = 0
        for h in hashes:
            if self.where(h) in (None, "device"):
                continue
            if moves.fetch(self, h, up=True, count=False) is not None:
                moved += 1
                self._settle()
        return moved

    def offload(self, hashes: Iterable[bytes], tier: str = "host") -> int:
        """Move ``hashes`` down to ``tier`` ("host" or "disk") now, unless pinned; returns how many moved.

        Runs on the mover, the caller waiting (inline when called there, as the
        lifecycle half's offloads are: see :meth:`submit`). The lock is taken per move
        step, never across a copy or a file write, so the event loop's calls (stats,
        holds, peer pulls) go between them.
        """
        if tier not in ("host", "disk"):
            raise ValueError(f"offload tier must be 'host' or 'disk', got {tier!r}")
        return self.mover.run(moves.offload, self, list(hashes), tier)

    def evict_to_disk(self) -> int:
        """Free memory for Dask's memory monitor: move the lowest-scored movable block
        from memory (host tier first) to disk. Returns its bytes, or -1 if none could
        move. Never raises (``ManualEvictProto.evict``).

        The monitor calls it on the event loop and needs the bytes freed when it
        returns, so there it waits for one block's move, but only when the mover is
        idle: behind other moves (an offload can take seconds) it answers -1 at once,
        and Dask spills task data instead.
        """
        if on_event_loop() and self.mover.jobs:
            return -1
        return self.mover.run(moves.evict_one, self)

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the mover, after the moves asked for before (the lifecycle
        half times its offloads there, so the time is the move's, not the queue's)."""
        return self.mover.submit(fn, *args)

    def settled(self) -> Future:
        """Done once every move asked for so far has run."""
        return self.mover.submit(lambda: None)

    # -- accounting ----------------------------------------------------------------
    def stats(self) -> dict:
        """Blocks, bytes and counters per tier, for ``kvs.stats``."""
        with self.lock:
            return store_stats(self)

    def close(self) -> None:
        self.mover.close()
        if self._remove_own_folder is not None:
            self._remove_own_folder()
