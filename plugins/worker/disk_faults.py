"""What the block store does when the disk fails it: a damaged spill file, a full disk.

Neither is an exception for the store's callers. A damaged (or vanished) spill file is
a miss, counted as a checksum failure: the caller pulls the block from a peer or
recomputes it. A disk that takes no more (its budget, or a real ``ENOSPC``) keeps
blocks in the tier above; if that tier is over budget too, its unreferenced blocks
are dropped, lowest score first, to be recomputed later. Both are bookkeeping, run
under the store's lock by the store; neither touches a file (the store deletes a
damaged one after letting the lock go).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("dask_kvstate")


def damaged(store, h: bytes, err: Exception) -> str:
    """Spill file of ``h`` failed its check: forget the block (a miss from now on); the file to delete."""
    store.counters["disk"]["checksum_failures"] += 1
    logger.warning("kvstate: spilled block %s is damaged (%s); treating it as a miss", h.hex()[:12], err)
    path = store.disk.forget(h)
    store.ledger.forget(h)
    store.version += 1
    return path


def disk_full(store, err: Exception) -> None:
    """The disk took no more: keep blocks above, dropping unreferenced ones if over budget.

    Takes the store's lock (re-entrant: callers holding it may call this too).
    """
    with store.lock:
        store.counters["disk"]["full"] += 1
        logger.info("kvstate: %s", err)
        for lru in (store.host, store.device):
            while lru.total_weight > lru.n:
                victims = store.ledger.lowest(lru.order)
                if not victims:
                    break
                del lru[victims[0]]
                store.dropped(victims[0])
