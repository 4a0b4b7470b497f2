"""A worker's KV block store: device -> host -> disk tiers composed from zict parts.

The composition follows dask_cuda's DeviceHostFile::

    device = ScoredBuffer(fast={}, slow=host-side, n=device-bytes)   # CUDA tensors, or CPU ones
    host   = ScoredBuffer(fast={}, slow=disk,      n=host-bytes)     # pinned memory on CUDA
    disk   = DiskTier(<worker local dir>/kvstate-blocks, disk-bytes) # raw bytes + checksum

A block lives in exactly one tier (content-addressed: forks share it, whatever tier).
New and read blocks enter the device tier; when a tier passes its budget the block
with the lowest eviction score (reuse, idleness, size) moves one tier down.

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
import tempfile
import threading
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import zict

from dask_kvstate.blocks import nbytes
from dask_kvstate.plugins.worker import disk_faults
from dask_kvstate.plugins.worker.disk_format import CorruptBlockError
from dask_kvstate.plugins.worker.ledger import BlockLedger
from dask_kvstate.plugins.worker.store_stats import store_stats
from dask_kvstate.plugins.worker.tiers import DiskTier, ScoredBuffer
from dask_kvstate.state import TIERS

logger = logging.getLogger("dask_kvstate")


class TieredBlockStore:
    """KV blocks of one worker, in three tiers with byte budgets.

    Parameters
    ----------
    directory : str
        Folder for the disk tier (made 0700; its old contents are removed).
    device_bytes, host_bytes, disk_bytes : int
        Budgets of the tiers. The device tier may pass its budget only by blocks that
        are pinned in use.
    half_life_s : float
        Idle half-life in the eviction score.
    device : str or torch.device, optional
        Where device-tier tensors live; CUDA when available, else CPU.

    Examples
    --------
    >>> import tempfile, torch
    >>> store = TieredBlockStore(tempfile.mkdtemp(), device_bytes=100, host_bytes=100, disk_bytes=10**6)
    >>> for h in (b"a", b"b", b"c"):
    ...     store.put(h, torch.zeros(10))           # 40 bytes each
    >>> store.where(b"a"), store.where(b"c")       # the device tier holds 100 bytes
    ('host', 'device')
    >>> store.get(b"a") is not None, store.where(b"a")
    (True, 'device')
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
        self.counters: dict[str, Counter[str]] = {t: Counter() for t in TIERS}
        self.counters["store"] = Counter()
        self.device_peak = 0
        #: Bumped whenever a block enters or leaves the store (not when it changes tier).
        self.version = 0
        self._lock = threading.RLock()
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="kvstate-prefetch")

        self.disk = DiskTier(self.directory, disk_bytes, victims=self._disk_victims, on_drop=self.dropped)
        self._host = ScoredBuffer(
            {},
            self.disk,
            host_bytes,
            score=self.ledger.score,
            movable=self.ledger.movable,
            fast_to_slow_callbacks=[self._count("host", "spills")],
            slow_to_fast_callbacks=[self._count("host", "unspills")],
        )
        host_side: MutableMapping = self._host
        if self.device_type.type == "cuda":
            # Host copies are pinned, so moving them back up is an async DMA.
            host_side = zict.Func(
                lambda t: t.to("cpu").pin_memory(), lambda t: t.to(self.device_type, non_blocking=True), self._host
            )
        self._device = ScoredBuffer(
            {},
            host_side,
            device_bytes,
            score=self.ledger.score,
            movable=self.ledger.movable,
            fast_to_slow_callbacks=[self._count("device", "spills")],
            slow_to_fast_callbacks=[self._count("device", "unspills")],
        )
        #: The tiers as mappings, so ``h in store.host`` says where a block lives.
        self.device = self._device.fast
        self.host = self._host.fast

    # -- bookkeeping ---------------------------------------------------------------
    def _disk_victims(self) -> Iterator[bytes]:
        """Unreferenced blocks on disk, lowest score first (asked when the disk is full)."""
        return iter(self.ledger.lowest(self.disk))

    def dropped(self, h: bytes) -> None:
        """Bookkeeping for a block deleted from every tier to make room."""
        self.ledger.forget(h)
        self.counters["store"]["dropped"] += 1
        self.version += 1

    def _count(self, tier: str, what: str):
        def cb(key, value):
            self.counters[tier][what] += 1

        return cb

    def size_of(self, h: bytes) -> int:
        """Bytes of block ``h`` (0 if not stored). Locked: the serve path asks from the event loop."""
        with self._lock:
            return self.ledger.size_of(h)

    def _note_peak(self) -> None:
        self.device_peak = max(self.device_peak, int(self.device.total_weight))

    # -- mapping-like ----------------------------------------------------------------
    def where(self, h: bytes) -> str | None:
        """The tier holding ``h``, or None."""
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
        return iter([*self.device, *self.host, *self.disk])

    def __len__(self) -> int:
        return len(self.device) + len(self.host) + len(self.disk)

    @property
    def nbytes(self) -> int:
        return int(self.device.total_weight + self.host.total_weight + self.disk.total)

    def put(self, h: bytes, tensor: torch.Tensor) -> None:
        """Store a block in the device tier (a no-op if already stored anywhere)."""
        with self._lock:
            if h in self:
                return
            tensor = tensor.to(self.device_type, non_blocking=True)
            self.ledger.touch(h, hit=False, size=nbytes(tensor))
            self.counters["store"]["puts"] += 1
            self.version += 1
            try:
                self._device[h] = tensor
            except OSError as e:  # DiskFullError or a real disk error while spilling
                disk_faults.disk_full(self, e)
            self._note_peak()

    def get(self, h: bytes) -> torch.Tensor | None:
        """The block, brought up to the device tier; None on a miss (counted).

        Never raises for a damaged spill file or a full disk.
        """
        with self._lock:
            tier = self.where(h)
            for t in TIERS[: TIERS.index(tier) if tier else 3]:
                self.counters[t]["misses"] += 1
            if tier is None:
                return None
            self.ledger.touch(h, hit=True)  # before promotion, so the score sees this use
            try:
                value = self._device[h]
            except CorruptBlockError as e:
                disk_faults.damaged(self, h, e)
                return None
            except OSError as e:
                disk_faults.disk_full(self, e)
                value = self.peek(h)
                if value is None:
                    return None
            self.counters[tier]["hits"] += 1
            self._note_peak()
            return value

    def adopt(self, hashes: Sequence[bytes], joined: torch.Tensor, block_tokens: int) -> int:
        """Make blocks on the device tier views of ``joined``, their concatenation; returns how many.

        A resume reads a state's KV as one tensor, so the first resume on a worker joins
        the blocks (a copy); adopting that copy as the blocks' storage drops the
        originals, so the worker holds the state once, and later resumes join to a
        view (``blocks.join_blocks``). The bytes are the same, so weights don't change.
        A block that spills later is written from its view; the joined tensor's memory
        goes when its last block has left the device tier.
        """
        done = 0
        with self._lock:
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
        with self._lock:
            for tier in (self.device, self.host):
                v = tier.d.get(h)
                if v is not None:
                    return v
            if h in self.disk:
                try:
                    return self.disk[h]
                except CorruptBlockError as e:
                    disk_faults.damaged(self, h, e)
            return None

    def peek_memory(self, h: bytes) -> torch.Tensor | None:
        """The block if it sits in a memory tier (never reads disk), else None; like :meth:`peek`."""
        with self._lock:
            v = self.device.d.get(h)
            return v if v is not None else self.host.d.get(h)

    # -- protection ----------------------------------------------------------------
    def pin(self, owner: Hashable, hashes: Iterable[bytes]) -> None:
        """Keep ``hashes`` where they are while ``owner`` (a running task) uses them."""
        with self._lock:
            self.pins.set(owner, hashes)

    def unpin(self, owner: Hashable) -> None:
        with self._lock:
            if self.pins.clear(owner):
                self._rebalance()

    def pinned_by(self, owner: Hashable) -> bool:
        """Whether ``owner`` pins any block. No lock: one dict lookup, atomic under the GIL,
        so the worker plugin can skip :meth:`unpin` for the many tasks that pin nothing."""
        return owner in self.pins.by_owner

    def hold(self, owner: Hashable, hashes: Iterable[bytes]) -> None:
        """Never drop ``hashes`` while ``owner`` (a key holding a ref) exists."""
        with self._lock:
            self.holds.set(owner, hashes)

    def release(self, owner: Hashable) -> None:
        with self._lock:
            self.holds.clear(owner)

    def discard(self, hashes: Iterable[bytes]) -> int:
        """Drop the unreferenced, unpinned ones of ``hashes`` from every tier; returns bytes freed."""
        freed = 0
        with self._lock:
            for h in self.ledger.droppable(hashes):
                size = self.size_of(h)
                try:
                    del self._device[h]
                except KeyError:  # not stored here
                    continue
                self.ledger.forget(h)
                self.version += 1
                freed += size
        return freed

    def _rebalance(self) -> None:
        """Unpinned blocks may now move: bring every tier back under its budget."""
        try:
            self._device.evict_until_below_target()
            self._host.evict_until_below_target()
        except OSError as e:
            disk_faults.disk_full(self, e)

    # -- moving on request ---------------------------------------------------------
    def prefetch(self, hashes: Iterable[bytes]) -> Future:
        """Bring ``hashes`` up to the device tier in the background; the future gives how many moved."""
        hashes = list(hashes)
        return self._prefetcher.submit(self.promote, hashes)

    def promote(self, hashes: list[bytes]) -> int:
        """Bring ``hashes`` up to the device tier now; returns how many moved. Never raises."""
        moved = 0
        for h in hashes:
            with self._lock:
                tier = self.where(h)
                if tier in (None, "device"):
                    continue
                self.ledger.touch(h, hit=False)
                try:
                    self._device[h]
                    moved += 1
                except CorruptBlockError as e:
                    disk_faults.damaged(self, h, e)
                except OSError as e:
                    disk_faults.disk_full(self, e)
                self._note_peak()
        return moved

    def offload(self, hashes: Iterable[bytes], tier: str = "host") -> int:
        """Move ``hashes`` down to ``tier`` ("host" or "disk") now, unless pinned; returns how many moved.

        The lock is taken per block, not across the whole move: an offload writes a
        session's state to disk (seconds for gigabytes), and the event loop needs the
        lock meanwhile (stats, holds, peer pulls). Between two blocks those go first.
        """
        if tier not in ("host", "disk"):
            raise ValueError(f"offload tier must be 'host' or 'disk', got {tier!r}")
        moved = 0
        for h in hashes:
            with self._lock:
                if h in self.pins:
                    continue
                before = self.where(h)
                if before is None or TIERS.index(before) >= TIERS.index(tier):
                    continue
                try:
                    if h in self.device:
                        self.device.evict(h)
                    if tier == "disk" and h in self.host:
                        self.host.evict(h)
                except OSError as e:
                    disk_faults.disk_full(self, e)
                after = self.where(h)
                moved += after is not None and TIERS.index(after) >= TIERS.index(tier)
        return moved

    def evict_to_disk(self) -> int:
        """Free memory for Dask's memory monitor: move the lowest-scored movable block
        from memory (host tier first) to disk. Returns its bytes, or -1 if none could
        move. Never raises (``ManualEvictProto.evict``)."""
        with self._lock:
            try:
                if not any(self.ledger.movable(k) for k in self.host) and self.device:
                    self.device.evict()  # down to host first
                key, _, w = self.host.evict()
                return int(w) if key is not None else -1
            except KeyError:
                return -1
            except OSError as e:
                disk_faults.disk_full(self, e)
                return -1

    # -- accounting ----------------------------------------------------------------
    def stats(self) -> dict:
        """Blocks, bytes and counters per tier, for ``kvs.stats``."""
        with self._lock:
            return store_stats(self)

    def close(self) -> None:
        self._prefetcher.shutdown(wait=False)
