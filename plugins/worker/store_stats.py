"""A block store's numbers for ``kvs.stats``: blocks, bytes and counters per tier."""

from __future__ import annotations

from dask_kvstate.plugins.worker.arena import overhang
from dask_kvstate.state import TIERS


def held_bytes(store) -> int:
    """Bytes of the stored blocks some ref holds (reported as ``pinned_bytes``)."""
    return sum(store.size_of(h) for h in store.holds.count if h in store)


def store_stats(store) -> dict:
    """The stats of ``store`` (a ``TieredBlockStore``), read under its lock by the caller."""
    counters = store.counters
    tiers = {
        "device": {
            "blocks": len(store.device),
            "bytes": int(store.device.total_weight),
            "capacity": int(store.device.n),
            "peak_bytes": int(store.device_peak),
        },
        "host": {"blocks": len(store.host), "bytes": int(store.host.total_weight), "capacity": int(store.host.n)},
        "disk": {"blocks": len(store.disk), "bytes": int(store.disk.total), "capacity": store.disk.capacity},
    }
    for t in TIERS:
        tiers[t].update({w: counters[t][w] for w in ("hits", "misses", "spills", "unspills")})
    tiers["disk"].update({w: counters["disk"][w] for w in ("checksum_failures", "full")})
    return {
        "tier": store.tier,
        "blocks": len(store),
        "bytes": store.nbytes,
        "pinned_bytes": held_bytes(store),
        "hits": sum(counters[t]["hits"] for t in TIERS),
        "misses": counters["disk"]["misses"],
        "evictions": counters["device"]["spills"] + counters["store"]["dropped"],
        "dropped": counters["store"]["dropped"],
        # memory held beyond the tiers' weights: arenas (plugins/worker/arena.py)
        # kept alive by some of their blocks after others left memory
        "arena_overhang_bytes": overhang([*store.device.d.values(), *store.host.d.values()]),
        "tiers": tiers,
    }
