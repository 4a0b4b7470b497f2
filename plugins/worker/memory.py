"""Let Dask's memory monitor spill KV blocks before task data.

Dask's worker memory monitor spills through ``ManualEvictProto`` (distributed/spill.py):
when process memory passes ``distributed.worker.memory.spill`` it calls
``data.evict()`` until memory is back under target, as long as ``data.fast`` is
non-empty. KV blocks live in our store, not in ``worker.data``, so without this the
monitor would spill small task results while gigabytes of KV stay in RAM, or worse,
call the worker out of memory. :class:`KVStateSpillData` wraps the worker's data
mapping: every mapping operation goes to the wrapped one, and ``evict`` first moves
the lowest-scored KV block from memory to the disk tier, falling back to the wrapped
mapping's own ``evict`` when no block can move.
"""

from __future__ import annotations

from collections.abc import MutableMapping


class KVStateSpillData(MutableMapping):
    """``worker.memory_manager.data`` with KV blocks first in the eviction line."""

    def __init__(self, data: MutableMapping, store):
        self.data = data
        self.store = store

    # -- ManualEvictProto ----------------------------------------------------------
    @property
    def fast(self):
        """Truthy while anything (KV in memory tiers, or task data) could be spilled."""
        return bool(len(self.store.host) or len(self.store.device)) or getattr(self.data, "fast", False)

    def evict(self) -> int:
        """Spill one KV block (or else one task result); its bytes, or -1. Never raises."""
        freed = self.store.evict_to_disk()
        if freed > 0:
            return freed
        # The store may hold only pinned blocks while the wrapped buffer is empty: its
        # evict() raises KeyError then, which would kill the memory monitor's callback.
        evict = getattr(self.data, "evict", None)
        if evict is None or not getattr(self.data, "fast", None):
            return -1
        return evict()

    # -- MutableMapping: all to the wrapped mapping ------------------------------------
    def __getitem__(self, key):
        return self.data[key]

    def __setitem__(self, key, value):
        self.data[key] = value

    def __delitem__(self, key):
        del self.data[key]

    def __contains__(self, key):
        return key in self.data

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)

    def __getattr__(self, name):
        # SpillBuffer extras (spilled_total, memory, ...) used by Dask's diagnostics.
        return getattr(self.__dict__["data"], name)
