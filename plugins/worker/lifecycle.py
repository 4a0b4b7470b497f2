"""The ``kvstate-lifecycle`` worker plugin: the worker half of the KV lifecycle extension.

It keeps, per session (the ``kvstate-session`` annotation of the task that produced a
state), the blocks of every state created in that session, and holds them in the block
store under the owner ``("session", id)``: a hold lets a block spill down a tier but
never be dropped, so a session's conversation survives between its invocations even
after Dask forgot the futures that held its refs (the store's own refcounts only cover
refs still in memory). The scheduler's ``kvstate-lifecycle`` extension then moves those
blocks by messages:

* ``kvstate-offload`` (stream): move the session's own blocks down to host or disk now;
* ``kvstate-prefetch`` (stream): bring them back to the device tier in the store's
  prefetch thread, off the event loop and off the task threads;
* ``kvstate_lifecycle_invalidate`` (RPC): the session ended: release its hold and drop
  every block no other session or live ref still holds; answers the bytes freed, left
  and shared.

Moves are timed per tier (bytes per second, offload and restore apart) and those rates,
probed once at setup on a scratch store with the model's block size and then updated by
every real move, are what the scheduler prices moves with. Nothing here is assumed.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from distributed import Worker, WorkerPlugin
from tornado.ioloop import PeriodicCallback

from dask_kvstate import config
from dask_kvstate.plugins.worker.handshake import hello
from dask_kvstate.protocol import (
    INVALIDATE,
    LIFECYCLE_DONE,
    LIFECYCLE_EXTENSION,
    LIFECYCLE_REPORT,
    LIFECYCLE_WORKER_PLUGIN,
    OFFLOAD,
    PREFETCH,
    SESSION_ANNOTATION,
    WORKER_PLUGIN,
)
from dask_kvstate.state import KVStateRef, refs_in

logger = logging.getLogger("dask_kvstate")

LOWER = ("host", "disk")


class Rates:
    """Measured bytes per second of moves between tiers, one exponential average per move.

    Examples
    --------
    >>> r = Rates()
    >>> r.add("offload", "host", 1_000_000, 0.001)
    >>> r.add("offload", "host", 1_000_000, 0.003)
    >>> round(r.per_s[("offload", "host")] / 1e6, 1)
    666.7
    """

    def __init__(self, alpha: float = 0.5):
        self.alpha = alpha
        self.per_s: dict[tuple[str, str], float] = {}

    def add(self, move: str, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        old = self.per_s.get((move, tier))
        self.per_s[(move, tier)] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate

    def as_dict(self) -> dict:
        return {f"{m}:{t}": r for (m, t), r in self.per_s.items()}


def probe_rates(block_bytes: int, blocks: int = 4) -> Rates:
    """Time offload and restore of a few blocks of ``block_bytes`` per lower tier on a scratch store.

    Seeds the rates before the first real move; a real store would need real KV to move.
    """
    import torch

    from dask_kvstate.plugins.worker.block_store import TieredBlockStore

    rates = Rates()
    folder = tempfile.mkdtemp(prefix="kvstate-probe-")
    try:
        big = 1 << 40
        store = TieredBlockStore(folder, device_bytes=big, host_bytes=big, disk_bytes=big)
        n = max(block_bytes // 2, 1)
        hashes = [bytes([i]) * 32 for i in range(blocks)]
        for h in hashes:
            store.put(h, torch.ones(n, dtype=torch.float16))
        total = sum(store.size_of(h) for h in hashes)
        for tier in LOWER:
            t0 = time.perf_counter()
            store.offload(hashes, tier)
            rates.add("offload", tier, total, time.perf_counter() - t0)
            t0 = time.perf_counter()
            store.promote(hashes)
            rates.add("restore", tier, total, time.perf_counter() - t0)
        store.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rates


class KVLifecycleWorkerPlugin(WorkerPlugin):
    """Session holds, offload / prefetch / invalidate handlers, and tier-rate reports.

    Parameters
    ----------
    report_interval : str or float, optional
        How often the per-session byte counts are sent, only when they changed
        (default ``kvstate.lifecycle.report-interval``).
    """

    name = LIFECYCLE_WORKER_PLUGIN
    idempotent = True
    worker: Worker  # set by setup()

    def __init__(self, report_interval: str | float | None = None):
        self.report_s = config.get_seconds("lifecycle.report-interval", report_interval)

    async def setup(self, worker: Worker) -> None:
        self.worker = worker
        self.blocks: dict[str, set[bytes]] = defaultdict(set)  # session -> blocks of its states
        self.counters: dict[str, int] = defaultdict(int)
        self.rates = Rates()
        self._sent: dict | None = None
        self._reporter = None
        self._mover = ThreadPoolExecutor(1, thread_name_prefix="kvstate-offload")
        worker.stream_handlers[OFFLOAD] = self._offload
        worker.stream_handlers[PREFETCH] = self._prefetch
        worker.handlers[INVALIDATE] = self._invalidate
        if self.store is not None:
            self.rates = await asyncio.to_thread(self._probe)
        # Report only to a scheduler that runs the lifecycle extension.
        if LIFECYCLE_EXTENSION in await hello(worker, self.name):
            self._reporter = PeriodicCallback(self._report, self.report_s * 1000)
            self._reporter.start()

    def teardown(self, worker) -> None:
        if self._reporter is not None:
            self._reporter.stop()
        for name in (OFFLOAD, PREFETCH):
            worker.stream_handlers.pop(name, None)
        worker.handlers.pop(INVALIDATE, None)
        self._mover.shutdown(wait=False)

    def _probe(self) -> Rates:
        rt = self.worker.plugins[WORKER_PLUGIN].runtime  # type: ignore[attr-defined]
        return probe_rates(rt.backend.kv_bytes_per_token * rt.block_tokens)

    @property
    def store(self):
        worker = getattr(self, "worker", None)  # None before setup
        plugin = worker.plugins.get(WORKER_PLUGIN) if worker is not None else None
        return None if plugin is None or plugin.runtime is None else plugin.runtime.store

    # -- session holds ---------------------------------------------------------------
    def transition(self, key, start, finish, **kwargs) -> None:
        if finish != "memory" or start != "executing":
            return
        ts = self.worker.state.tasks.get(key)
        sid = (ts.annotations or {}).get(SESSION_ANNOTATION) if ts is not None else None
        store = self.store
        if (
            ts is None
            or sid is None
            or store is None
            or ts.type not in (KVStateRef, list, tuple)
            or key not in self.worker.data
        ):
            return
        refs = refs_in(self.worker.data.get(key))
        if refs:
            held = self.blocks[sid]
            for r in refs:
                held.update(r.blocks)
            store.hold(("session", sid), held)

    def _own(self, sid: str) -> list[bytes]:
        """The session's blocks no other session holds (those move with it)."""
        others = set()
        for other, hs in self.blocks.items():
            if other != sid:
                others |= hs
        return [h for h in self.blocks.get(sid, ()) if h not in others]

    def session_bytes(self, store) -> dict[str, dict[str, int]]:
        out = {}
        for sid in list(self.blocks):
            per = {"device": 0, "host": 0, "disk": 0}
            for h in self._own(sid):
                tier = store.where(h)
                if tier is not None:
                    per[tier] += store.size_of(h)
            out[sid] = per
        return out

    # -- handlers --------------------------------------------------------------------
    def _offload(self, session=None, tier="host", decision=None, **_) -> None:
        store = self.store
        if store is None or session not in self.blocks:
            return
        hashes = [
            h for h in self._own(session) if store.where(h) == "device" or (tier == "disk" and store.where(h) == "host")
        ]
        # Writing to disk (bytes + checksum) must not stall the event loop: one thread, in order.
        self._mover.submit(self._offload_now, store, session, hashes, tier, decision)

    def _offload_now(self, store, session, hashes, tier, decision) -> None:
        nbytes = sum(store.size_of(h) for h in hashes)
        t0 = time.perf_counter()
        moved = store.offload(hashes, tier)
        self._moved("offload", session, decision, tier, moved, nbytes, time.perf_counter() - t0)

    def _moved(self, action: str, session, decision, tier: str, moved: int, nbytes: int, seconds: float) -> None:
        """Account a finished offload or prefetch (from its thread) and report it from the event loop."""
        if moved:  # a move that moved nothing measured no rate
            self.rates.add("offload" if action == "offload" else "restore", tier, nbytes, seconds)
        count, volume = ("offloads", "offloaded_bytes") if action == "offload" else ("prefetches", "prefetched_bytes")
        self.counters[count] += 1
        self.counters[volume] += nbytes
        self.worker.loop.add_callback(
            self._done, action, session, decision, tier=tier, blocks=moved, nbytes=nbytes, seconds=seconds
        )

    def _prefetch(self, session=None, decision=None, **_) -> None:
        store = self.store
        if store is None or session not in self.blocks:
            return
        hashes = [h for h in self._own(session) if store.where(h) in LOWER]
        tiers = {store.where(h) for h in hashes}
        tier = "disk" if "disk" in tiers else "host"
        nbytes = sum(store.size_of(h) for h in hashes)
        t0 = time.perf_counter()
        fut = store.prefetch(hashes)

        def finished(f) -> None:  # in the prefetch thread
            moved = f.result() if f.exception() is None else 0
            self._moved("prefetch", session, decision, tier, moved, nbytes, time.perf_counter() - t0)

        fut.add_done_callback(finished)

    async def _invalidate(self, session=None) -> dict:
        """Drop what ``session`` alone kept; never raises for an unknown session."""
        store = self.store
        hashes = self.blocks.pop(session, set())
        if store is None:
            return {"freed": 0, "left": 0, "shared": 0, "blocks": 0}
        store.release(("session", session))
        freed = store.discard(hashes)
        left = sum(store.size_of(h) for h in hashes if h in store)
        # What stays is held by a live session or a live ref: shared, not left behind.
        shared = sum(store.size_of(h) for h in hashes if h in store and h in store.holds)
        self.counters["invalidations"] += 1
        self.counters["invalidated_bytes"] += freed
        return {"freed": freed, "left": left - shared, "shared": shared, "blocks": len(hashes)}

    def _done(self, action: str, session: str, decision, **outcome) -> None:
        if self._reporter is not None and self.worker.batched_stream is not None:
            self.worker.batched_stream.send(
                {"op": LIFECYCLE_DONE, "action": action, "session": session, "decision": decision, **outcome}
            )

    def _report(self) -> None:
        store = self.store
        if store is None or self.worker.batched_stream is None or self.worker.batched_stream.comm is None:
            return
        if not self.rates.per_s:  # the kvstate plugin came after this one: probe now, once
            self.rates = self._probe()
        s = store.stats()["tiers"]
        msg = {
            "sessions": self.session_bytes(store),
            "rates": self.rates.as_dict(),
            "device": {"bytes": s["device"]["bytes"], "capacity": s["device"]["capacity"]},
            "host": {"bytes": s["host"]["bytes"], "capacity": s["host"]["capacity"]},
        }
        if msg != self._sent:
            self._sent = msg
            self.worker.batched_stream.send({"op": LIFECYCLE_REPORT, **msg})

    def stats(self) -> dict:
        return {**dict(self.counters), "sessions": len(self.blocks), "rates": self.rates.as_dict()}
