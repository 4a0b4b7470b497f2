"""How a block store's blocks change tier without holding its lock across I/O, or running on the event loop.

Every move that writes (device -> host copy, host -> disk file) runs on the store's one
mover thread (:class:`Mover`), in three steps (:func:`move_down`):

1. under the store's lock, note the block's value and reserve room below;
2. without the lock, copy it to host memory or write its file;
3. under the lock again, commit only if the block is still there, the same value, and
   not pinned: else undo (the copy is dropped, the file deleted, the room given back).

Until the commit the block stays in the tier above, so a concurrent read gets that
in-memory copy; a block discarded or pinned meanwhile stays discarded, or stays put,
and leaves no file behind. Reads that bring a block up (:func:`fetch`) work the same
way, on the reading thread: a task thread may read a file (it is not the event loop),
the lock is taken only to look and to commit. Everything else (what is where, budgets,
the ledger) changes only under the lock, so budget accounting stays exact.

Why one thread: moves never race one another, so the steps above only have to guard
against readers and bookkeeping, not against a second mover picking the same victim or
the same disk room; and they keep their order (an offload is not overtaken by the
prefetch asked for after it). Why not distributed's offload executor: it is shared with
(de)serialisation of large messages, which would wait behind seconds of spill writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import torch

from dask_kvstate.plugins.worker import disk_faults
from dask_kvstate.plugins.worker.disk_format import CorruptBlockError
from dask_kvstate.state import TIERS

logger = logging.getLogger("dask_kvstate")

#: Times a read looks again for a block that moved while it was being read.
READ_TRIES = 4


def on_event_loop() -> bool:
    """Whether this thread runs an asyncio loop (a worker's event loop): it must never wait."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Mover:
    """The store's single mover thread, and rebalances coalesced into one pass at a time.

    Parameters
    ----------
    drain : callable
        One rebalancing pass (:func:`drain` on the store).
    """

    def __init__(self, drain: Callable[[], None]):
        self._drain = drain
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvstate-store")
        self._thread: int | None = None  # the mover's ident, known from its first job
        self._pending: Future | None = None  # a pass asked for and not yet started
        self._lock = threading.RLock()  # a done callback may run inside submit's own critical section
        #: Jobs submitted and not finished (passes included).
        self.jobs = 0

    def _call(self, fn: Callable, *args):
        # Not an executor initializer: its thread would hold this object (and the store) for good.
        self._thread = threading.get_ident()
        return fn(*args)

    def here(self) -> bool:
        """Whether this is the mover thread."""
        return self._thread == threading.get_ident()

    def _finished(self, fut: Future) -> None:
        with self._lock:
            self.jobs -= 1

    def submit(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the mover thread, after everything submitted before it.

        After :meth:`close` it runs here and now instead (a closing worker's last calls).
        """
        with self._lock:
            try:
                queued = self._executor.submit(self._call, fn, *args)
            except RuntimeError:  # shut down
                pass
            else:
                self.jobs += 1
                queued.add_done_callback(self._finished)
                return queued
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:
            fut.set_exception(e)
        return fut

    def run(self, fn: Callable, *args):
        """``fn(*args)`` on the mover thread, waiting for it; inline when already there."""
        if self.here():
            return fn(*args)
        return self.submit(fn, *args).result()

    def rebalance(self) -> Future:
        """A rebalancing pass that starts after this call (one already queued serves)."""
        with self._lock:  # the pass clears _pending under this lock: it sees the one set here
            if self._pending is None:
                try:
                    self._pending = self._executor.submit(self._call, self._pass)
                except RuntimeError:  # shut down: nothing rebalances any more
                    done: Future = Future()
                    done.set_result(None)
                    return done
                self.jobs += 1
                self._pending.add_done_callback(self._finished)
            return self._pending

    def _pass(self) -> None:
        with self._lock:
            self._pending = None  # a rebalance asked for from now on needs a pass of its own
        try:
            self._drain()
        except Exception:  # a bug must not stop later moves
            logger.exception("kvstate: rebalancing the block store failed")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def wait(fut: Future) -> None:
    """Wait for a move; one cancelled by a closing store is no error."""
    with contextlib.suppress(CancelledError):
        fut.result()


# -- the two-phase move down ------------------------------------------------------------


def to_host(store, value: torch.Tensor) -> torch.Tensor:
    """The host tier's copy of a device-tier block: the block itself off CUDA; on CUDA a
    pinned host copy, so moving it back up is an async DMA."""
    if store.device_type.type != "cuda":
        return value
    return value.to("cpu").pin_memory()


def to_device(store, value: torch.Tensor) -> torch.Tensor:
    return value if value.device == store.device_type else value.to(store.device_type, non_blocking=True)


def move_down(store, key: bytes, src: str) -> bool:
    """Move ``key`` from tier ``src`` ("device" or "host") one tier down; whether it moved.

    Raises :class:`DiskFullError` when the disk refuses it (the block stays above).
    """
    upper = store.device if src == "device" else store.host
    doomed: list[str] = []
    with store.lock:
        value = upper.d.get(key)
        if value is None or key in store.pins:
            return False
        size = upper.weights[key]
        if src == "host":
            doomed = store.disk.reserve(size)
    name = ""
    try:
        for path in doomed:
            store.disk.remove(path)
        copy = to_host(store, value) if src == "device" else None
        if src == "host":
            name = store.disk.write(key, value)
    except BaseException:
        if src == "host":
            with store.lock:
                store.disk.unreserve(size)
        raise
    stale = ""
    with store.lock:
        moved = upper.d.get(key) is value and key not in store.pins
        if src == "host":
            if moved:
                store.disk.commit(key, size)
            else:  # dropped, replaced or pinned meanwhile: no file may stay behind
                store.disk.unreserve(size)
                stale = store.disk.abandon(key, name)
        elif moved:
            store.host.set_noevict(key, copy)
        if moved:
            del upper[key]
            store.counters[src]["spills"] += 1
    store.disk.remove(stale)
    return moved


def room_in_host(store, size: int) -> bool:
    """Spill host blocks to disk until ``size`` more bytes fit (or nothing there may move).

    False only if the disk refused: then the block meant for the host tier stays where
    it is. A host tier full of pinned blocks takes it anyway, over its budget, as zict
    would: pins are what may keep a tier over budget.
    """
    host = store.host
    while host.total_weight + size > host.n:
        with store.lock:
            victims = host.victims()
        if not victims:
            return True
        progressed = False
        for key in victims:
            if host.total_weight + size <= host.n:
                return True
            try:
                progressed |= move_down(store, key, "host")
            except OSError as e:
                disk_faults.disk_full(store, e)
                return False
        if not progressed:
            return True
    return True


def spill_from_device(store, key: bytes) -> bool | None:
    """``key`` down to the host tier, making room there first: whether it moved, None if
    the disk refused the room (then nothing else fits below either)."""
    with store.lock:
        size = store.device.weights.get(key, 0)
    heavy = size > store.host.n  # heavier than the whole host tier: it goes on to disk at once
    if not size or not room_in_host(store, 0 if heavy else size):
        return None if size else False
    if not move_down(store, key, "device"):
        return False
    if heavy:
        try:
            move_down(store, key, "host")
        except OSError as e:
            disk_faults.disk_full(store, e)
    return True


def drain(store) -> None:
    """Bring the memory tiers back under their budgets, as far as pins and the disk allow.

    The device tier's victims are chosen once per round (by score, under the lock), then
    moved one by one, each re-checked at its commit.
    """
    device = store.device
    while device.total_weight > device.n:
        with store.lock:
            victims = device.victims()
        moved = 0
        for key in victims:
            if device.total_weight <= device.n:
                break
            done = spill_from_device(store, key)
            if done is None:  # disk_full() has dropped what it could
                return
            moved += done
        if not moved:
            break
    if store.host.total_weight > store.host.n:  # blocks unpinned in the host tier
        room_in_host(store, 0)


def offload(store, hashes: list[bytes], tier: str) -> int:
    """Move ``hashes`` down to ``tier`` unless pinned (``TieredBlockStore.offload``, on the mover)."""
    moved = 0
    for h in hashes:
        with store.lock:
            before = store.where(h)
            if h in store.pins or before is None or TIERS.index(before) >= TIERS.index(tier):
                continue
        try:
            if before == "device":
                spill_from_device(store, h)
            if tier == "disk" and store.where(h) == "host":
                move_down(store, h, "host")
        except OSError as e:
            disk_faults.disk_full(store, e)
        after = store.where(h)
        moved += after is not None and TIERS.index(after) >= TIERS.index(tier)
    return moved


def evict_one(store) -> int:
    """The lowest-scored movable memory block (host tier first) to disk: its bytes, or -1
    (``TieredBlockStore.evict_to_disk``, on the mover)."""
    try:
        with store.lock:
            victims = store.host.victims()
            below = [] if victims else store.device.victims()
        if below:
            if not spill_from_device(store, below[0]):
                return -1
            with store.lock:
                victims = store.host.victims()
        for key in victims:
            with store.lock:
                size = store.host.weights.get(key, 0)
            if move_down(store, key, "host"):
                return int(size)
        return -1
    except OSError as e:
        disk_faults.disk_full(store, e)
        return -1


# -- reads --------------------------------------------------------------------------------


def fetch(store, h: bytes, *, up: bool, count: bool):
    """Block ``h`` from whichever tier holds it, a file read on this thread; None on a miss.

    ``up`` brings it to the device tier, committed only if it did not move meanwhile
    (else it looks again); ``count`` counts the hit or the misses. A damaged file is a
    miss, counted as a checksum failure. Never raises for a damaged or vanished file.
    """
    first = None
    for attempt in range(READ_TRIES):
        name = value = None
        with store.lock:
            tier = store.where(h)
            if attempt == 0:
                first = tier
                if count:
                    for t in TIERS[: TIERS.index(tier) if tier else 3]:
                        store.counters[t]["misses"] += 1
                if up and tier is not None and (count or tier != "device"):
                    store.ledger.touch(h, hit=count)  # before promotion, so the score sees this use
            if tier is None:
                return None
            if tier == "device":
                found = store.device[h] if up else store.device.d[h]
                store.counters[first]["hits"] += count
                return found
            if tier == "host":
                value = store.host.d[h]
                if not up:
                    return value
            else:
                name = store.disk.name_of(h)
        if name is not None:
            try:
                value = store.disk.read(name)
            except (FileNotFoundError, CorruptBlockError) as e:
                stale = None
                with store.lock:
                    if store.disk.name_of(h) == name:  # not a race: the file itself is damaged or gone
                        err = e if isinstance(e, CorruptBlockError) else CorruptBlockError("KV block file vanished")
                        stale = disk_faults.damaged(store, h, err)
                if stale is None:
                    continue  # moved or dropped meanwhile: look again
                store.remove_files([stale])  # a read may come from the event loop (a peer's pull)
                return None
            if not up:
                return value
        assert value is not None, f"block {h.hex()[:12]} on disk without a file name"
        block = to_device(store, value)
        stale = ""
        with store.lock:
            if name is None and store.host.d.get(h) is value:
                store.device.set_noevict(h, block)
                del store.host[h]
            elif name is not None and store.disk.name_of(h) == name:
                store.device.set_noevict(h, block)
                stale = store.disk.forget(h)
                store.counters["host"]["unspills"] += 1  # disk -> host -> device, as the tiers chain
            elif h in store.device.d:
                return store.device.d[h]  # brought up by another reader meanwhile
            else:
                continue  # moved down or dropped meanwhile: look again
            store.counters["device"]["unspills"] += 1
            store.counters[first]["hits"] += count
        store.remove_files([stale])
        return block
    return None
