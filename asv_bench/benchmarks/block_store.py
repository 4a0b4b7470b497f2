"""The tiered block store against raw zict on the same bytes.

The raw baseline is what Dask itself spills with: ``zict.Buffer`` over
``zict.Func(pickle.dumps, pickle.loads, zict.File)``. Ours adds scored eviction, pins,
holds, the checked raw disk format and stats. Both run in the same benchmark process on
the same seeded blocks; ``TierOps.track_ratio`` is ours / raw (below 1 is faster than zict).
"""

from __future__ import annotations

import pickle
import shutil
import tempfile
import time

import torch
import zict

from . import common  # noqa: F401  (torch's threads: see common.TORCH_THREADS)

N_BLOCKS = 32


def blocks(block_bytes: int) -> dict[bytes, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {i.to_bytes(16, "big"): torch.randn(block_bytes // 4, generator=g) for i in range(N_BLOCKS)}


class _Pair:
    """One of ours and one raw zict chain over the same blocks, both with room for everything."""

    def __init__(self, data: dict[bytes, torch.Tensor]):
        from dask_kvstate.plugins.worker.block_store import TieredBlockStore

        self.dirs = [tempfile.mkdtemp(), tempfile.mkdtemp()]
        self.data = data
        big = 10 * sum(t.nelement() * t.element_size() for t in data.values())
        self.ours = TieredBlockStore(self.dirs[0], device_bytes=big, host_bytes=big, disk_bytes=big)
        weight = lambda k, v: v.nelement() * v.element_size()
        disk = zict.Func(pickle.dumps, pickle.loads, zict.File(self.dirs[1]))
        self.raw_host = zict.Buffer({}, disk, big, weight=weight)
        self.raw = zict.Buffer({}, self.raw_host, big, weight=weight)

    def close(self):
        self.ours.close()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)

    # -- the operations, on either side -------------------------------------------
    def put(self, ours: bool):
        for h, t in self.data.items():
            if ours:
                self.ours.put(h, t)
            else:
                self.raw[h] = t

    def get(self, ours: bool):
        for h in self.data:
            self.ours.get(h) if ours else self.raw[h]

    def spill(self, ours: bool, tier: str):
        hs = list(self.data)
        if ours:
            self.ours.offload(hs, tier)
            return
        for h in hs:
            self.raw.fast.evict(h)
            if tier == "disk":
                self.raw_host.fast.evict(h)


#: The operations each tier is measured on: put and get where blocks are made and read
#: (the device tier), spill to and unspill from the tiers below it.
TIER_OPS = {"device": ("put", "get"), "host": ("spill", "unspill"), "disk": ("spill", "unspill")}


class TierOps:
    """Per operation and tier, ours / raw zict (``track_ratio``). Pairs that
    :data:`TIER_OPS` does not list are skipped in ``setup``."""

    params = (
        ["put", "get", "spill", "unspill"],
        list(TIER_OPS),
        [8 * 1024, 2_949_120],  # a tiny-llama block, a SmolLM2 64-token block
    )
    param_names = ["op", "tier", "block_bytes"]
    timeout = 600

    def setup(self, op, tier, block_bytes):
        if op not in TIER_OPS[tier]:
            raise NotImplementedError(f"{op} is not measured on the {tier} tier")  # asv: skip
        self.data = blocks(block_bytes)

    def _time(self, op: str, tier: str, ours: bool) -> float:
        """Best of three, each on a fresh pair prepared up to the operation."""
        best = float("inf")
        for _ in range(3):
            pair = _Pair(self.data)
            if op in ("get", "unspill", "spill"):
                pair.put(ours)
            if op == "unspill":
                pair.spill(ours, tier)
            t0 = time.perf_counter()
            if op == "put":
                pair.put(ours)
            elif op == "spill":
                pair.spill(ours, tier)
            else:
                pair.get(ours)
            best = min(best, time.perf_counter() - t0)
            pair.close()
        return best

    def track_ratio(self, op, tier, block_bytes):
        return self._time(op, tier, ours=True) / self._time(op, tier, ours=False)

    track_ratio.unit = "ours/zict"


class StatsDuringOffload:
    """How long ``store.stats()`` (what the event loop calls every report interval) waits
    while another thread offloads a 4,096-token SmolLM2-shaped state (64 blocks, 180 MiB)
    to disk: the store's lock is taken per block, so the wait is about one block's move."""

    timeout = 120

    def setup(self):
        from dask_kvstate.blocks import block_hashes, kv_identity
        from dask_kvstate.plugins.worker.arena import split_blocks
        from dask_kvstate.plugins.worker.block_store import TieredBlockStore

        self.dir = tempfile.mkdtemp()
        kv = torch.randn(30, 2, 3, 4096, 64, generator=torch.Generator().manual_seed(0))
        self.hashes = block_hashes(range(4096), identity=kv_identity("m", "c"), namespace="asv", block_tokens=64)
        self.store = TieredBlockStore(self.dir, device_bytes=2**31, host_bytes=2**31, disk_bytes=2**33)
        for b in split_blocks(kv, self.hashes, 64):
            self.store.put(b.hash, b.tensor)

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def track_longest_stats_wait_ms(self):
        import threading

        done, waits = threading.Event(), []
        mover = threading.Thread(target=lambda: (self.store.offload(list(self.hashes), "disk"), done.set()))
        mover.start()
        while not done.is_set():
            t0 = time.perf_counter()
            self.store.stats()
            waits.append(time.perf_counter() - t0)
            time.sleep(0.005)
        mover.join()
        return 1e3 * max(waits)

    track_longest_stats_wait_ms.unit = "ms"


class LoopGapAtTaskEnd:
    """The event loop's longest gap while a finished task's 4,096-token SmolLM2-shaped
    state (64 blocks, 180 MiB) spills to disk. The task's ``unpin`` runs on the loop (the
    plugin's transition hook) and takes the tiers over budget (8 blocks each); the store's
    mover thread writes the spill files, so the gap stays at a GIL switch or two."""

    timeout = 180

    def setup(self):
        from dask_kvstate.blocks import block_hashes, kv_identity
        from dask_kvstate.plugins.worker.arena import split_blocks
        from dask_kvstate.plugins.worker.block_store import TieredBlockStore

        self.dir = tempfile.mkdtemp()
        kv = torch.randn(30, 2, 3, 4096, 64, generator=torch.Generator().manual_seed(0))
        hashes = block_hashes(range(4096), identity=kv_identity("m", "c"), namespace="asv", block_tokens=64)
        budget = 8 * 30 * 2 * 3 * 64 * 64 * 4
        self.store = TieredBlockStore(self.dir, device_bytes=budget, host_bytes=budget, disk_bytes=2**33)
        self.store.pin(("task", "k"), hashes)  # the running task's: nothing spills before it ends
        for b in split_blocks(kv, hashes, 64):
            self.store.put(b.hash, b.tensor)

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def track_longest_loop_gap_ms(self):
        import asyncio

        async def task_end() -> float:
            loop = asyncio.get_running_loop()
            longest, done = 0.0, False

            async def ticks():  # a 2 ms tick: how late each comes is how long the loop was kept
                nonlocal longest
                while not done:
                    t0 = loop.time()
                    await asyncio.sleep(0.002)
                    longest = max(longest, loop.time() - t0 - 0.002)

            ticker = asyncio.ensure_future(ticks())
            await asyncio.sleep(0.01)
            self.store.unpin(("task", "k"))
            await asyncio.wrap_future(self.store.settled())
            done = True
            await ticker
            return longest

        return 1e3 * asyncio.run(task_end())

    track_longest_loop_gap_ms.unit = "ms"
