"""The ``kvstate-lifecycle`` worker plugin: the worker half of the KV lifecycle extension.

It keeps, per session (the ``kvstate-session`` annotation of a task), every block a task
of that session used on this worker: the blocks it computed, pulled, recomputed or read
(what the task pinned while it ran, which the ``kvstate`` plugin hands to
``task_listeners`` before unpinning; adopted joined copies are those same blocks), and the
blocks of the refs it returned. They are held in the block store under the owner
``("session", id)``: a hold lets a block spill down a tier but never be dropped, so a
session's conversation survives between its invocations even after Dask forgot the
futures that held its refs (the store's own refcounts only cover refs still in memory).
A worker that only pulled a session's state holds its replica the same way, so the
session's end finds it. The scheduler's ``kvstate-lifecycle`` extension then moves those
blocks by messages:

* ``kvstate-offload`` (stream): move the session's own blocks down to host or disk now;
* ``kvstate-prefetch`` (stream): bring them back to the device tier on the store's
  mover thread, off the event loop and off the task threads;
* ``kvstate_lifecycle_invalidate`` (RPC): the session ended: release its hold and drop,
  in every tier, every block no other session or live ref still holds; answers the bytes
  freed, left and shared. What a live ref or a running task still held then is dropped
  once they let go, and a task of an ended session that finishes late holds nothing.

Moves are timed per tier (bytes per second, offload and restore apart) and those rates,
probed once at setup on a scratch store with the model's block size and then updated by
every real move, are what the scheduler prices moves with. Nothing here is assumed.
The periodic report costs the event loop a few counter reads when nothing changed, and
container copies when something did: the per-tier byte counts are summed in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections import defaultdict

from distributed import Worker, WorkerPlugin
from tornado.ioloop import PeriodicCallback

from dask_kvstate import config
from dask_kvstate.plugins.worker.handshake import goodbye, hello
from dask_kvstate.plugins.worker.session_blocks import SessionBlocks, tier_bytes
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
#: Ids of sessions ended on this worker that are remembered: a late task of one holds nothing.
ENDED_KEPT = 100_000
#: Blocks of ended sessions awaiting the release of a ref or a running task's pin.
LEFTOVERS_KEPT = 100_000


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
    goodbye_timeout : str or float, optional
        How long teardown waits for the scheduler to stop sending before the handlers go
        (default ``kvstate.lifecycle.goodbye-timeout``).

    Teardown (the plugin removed or replaced, or its worker closing) says goodbye to the
    scheduler first, so no invalidation reaches a worker without the handler, and then
    lets go of every session hold: a worker never keeps a session's KV held by a plugin
    that is no longer there to release it.
    """

    name = LIFECYCLE_WORKER_PLUGIN
    idempotent = True
    worker: Worker  # set by setup()

    def __init__(self, report_interval: str | float | None = None, goodbye_timeout: str | float | None = None):
        self.report_s = config.get_seconds("lifecycle.report-interval", report_interval)
        self.goodbye_s = config.get_seconds("lifecycle.goodbye-timeout", goodbye_timeout)

    async def setup(self, worker: Worker) -> None:
        self.worker = worker
        self.sessions = SessionBlocks()  # session -> blocks its tasks used here
        self.ended: dict[str, None] = {}  # sessions ended here, oldest first
        self.leftovers: dict[bytes, None] = {}  # ended sessions' blocks something else still held
        self.counters: dict[str, int] = defaultdict(int)
        self.rates = Rates()
        self._probed = False
        self._sent: dict | None = None
        self._counted: tuple | None = None  # what the last per-session byte count saw
        self._session_bytes: dict[str, dict[str, int]] = {}
        self._sweep_due = False
        self._reporter = None
        self._announced = False  # whether the scheduler's lifecycle extension heard this plugin's hello
        worker.stream_handlers[OFFLOAD] = self._offload
        worker.stream_handlers[PREFETCH] = self._prefetch
        worker.handlers[INVALIDATE] = self._invalidate
        self._attach()
        if self.store is not None:
            self.rates = await asyncio.to_thread(self._probe)
            self._probed = True
        # Report only to a scheduler that runs the lifecycle extension.
        self._announced = LIFECYCLE_EXTENSION in await hello(worker, self.name)
        if self._announced:
            self._reporter = PeriodicCallback(self._report, self.report_s * 1000)
            self._reporter.start()

    async def teardown(self, worker) -> None:
        reporter = getattr(self, "_reporter", None)  # absent when setup failed early
        if reporter is not None:
            reporter.stop()
        if getattr(self, "_announced", False):
            # Dask tears plugins down while the scheduler still counts the worker as running:
            # until the lifecycle extension has heard this, it may still send an invalidation.
            await goodbye(worker, self.name, self.goodbye_s)
            self._announced = False
        for name in (OFFLOAD, PREFETCH):
            worker.stream_handlers.pop(name, None)
        worker.handlers.pop(INVALIDATE, None)
        listeners = getattr(worker.plugins.get(WORKER_PLUGIN), "task_listeners", None)
        if listeners is not None and self._task_used in listeners:
            listeners.remove(self._task_used)
        self._release_all()

    def _release_all(self) -> None:
        """Let go of every session hold: nothing would release them once this plugin is gone.

        The blocks stay in the store as ordinary cache (a live ref still holds its own),
        so a replacement plugin or a later pull can still hit them.
        """
        sessions = getattr(self, "sessions", None)
        store = self.store
        if sessions is None or store is None:  # the store went with the kvstate plugin, holds included
            return
        for sid in list(sessions.by_session):
            store.release(("session", sid))
            sessions.pop(sid)
        self.leftovers.clear()

    def _attach(self) -> None:
        """Hear from the ``kvstate`` plugin which blocks each finished task used (again after it is replaced)."""
        listeners = getattr(self.worker.plugins.get(WORKER_PLUGIN), "task_listeners", None)
        if listeners is not None and self._task_used not in listeners:
            listeners.append(self._task_used)

    def _probe(self) -> Rates:
        rt = self.worker.plugins[WORKER_PLUGIN].runtime  # type: ignore[attr-defined]
        return probe_rates(rt.backend.kv_bytes_per_token * rt.block_tokens)

    @property
    def store(self):
        worker = getattr(self, "worker", None)  # None before setup
        plugin = worker.plugins.get(WORKER_PLUGIN) if worker is not None else None
        return None if plugin is None or plugin.runtime is None else plugin.runtime.store

    # -- session holds ---------------------------------------------------------------
    def _session_of(self, key) -> str | None:
        ts = self.worker.state.tasks.get(key)
        return (ts.annotations or {}).get(SESSION_ANNOTATION) if ts is not None else None

    def _task_used(self, key, hashes) -> None:
        """A task stopped running having pinned ``hashes`` (computed, pulled, recomputed or read here)."""
        sid = self._session_of(key)
        if sid is not None and hashes:
            self._track(sid, hashes)
        if self.leftovers:
            self._sweep_soon()  # its pins go next: ended sessions' blocks it pinned may go then

    def transition(self, key, start, finish, **kwargs) -> None:
        if self.leftovers and start == "memory":
            self._sweep_soon()  # the key's refs let go: ended sessions' blocks may go now
        if finish != "memory" or start != "executing":
            return
        ts = self.worker.state.tasks.get(key)
        if ts is None or ts.type not in (KVStateRef, list, tuple) or key not in self.worker.data:
            return
        sid = (ts.annotations or {}).get(SESSION_ANNOTATION)
        if sid is None:
            return
        refs = refs_in(self.worker.data.get(key))
        if refs:
            self._track(sid, [h for r in refs for h in r.blocks])

    def _track(self, sid: str, hashes) -> None:
        store = self.store
        if store is None:
            return
        if sid in self.ended:  # a task that outlived its session's end: nothing to keep for it
            self.counters["late_blocks"] += len(hashes)
            self._leave(hashes)
            return
        if self.sessions.add(sid, hashes):
            store.hold(("session", sid), self.sessions.by_session[sid])

    def _leave(self, hashes) -> None:
        """Drop ``hashes`` of ended sessions as soon as no ref, pin or live session keeps them."""
        self.leftovers.update(dict.fromkeys(hashes))
        while len(self.leftovers) > LEFTOVERS_KEPT:  # the oldest stay as unreferenced cache
            self.leftovers.pop(next(iter(self.leftovers)))
        self._sweep_soon()

    def _sweep_soon(self) -> None:
        if not self._sweep_due:
            self._sweep_due = True  # once per loop turn: after this transition's unpins and releases
            self.worker.loop.add_callback(self._sweep)

    async def _sweep(self) -> None:
        self._sweep_due = False
        store = self.store
        if store is None:
            self.leftovers.clear()
            return
        # A block a live session holds goes with that session's end.
        hashes = [h for h in self.leftovers if not self.sessions.held_by_any(h)]
        freed = await asyncio.to_thread(store.discard, hashes) if hashes else 0
        for h in list(self.leftovers):
            if h not in store or self.sessions.held_by_any(h):
                del self.leftovers[h]
        self.counters["invalidated_bytes"] += freed
        self.counters["late_freed_bytes"] += freed

    # -- handlers --------------------------------------------------------------------
    def _offload(self, session=None, tier="host", decision=None, **_) -> None:
        store = self.store
        if store is None or session not in self.sessions:
            return
        # Writing to disk (bytes + checksum) must not stall the event loop: on the store's mover, in order.
        store.submit(self._offload_now, store, session, self.sessions.own(session), tier, decision)

    def _offload_now(self, store, session, own, tier, decision) -> None:
        store.unexpect(own)  # a prefetch's mark on them is stale now
        hashes = [h for h in own if store.where(h) == "device" or (tier == "disk" and store.where(h) == "host")]
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

    def _prefetch(self, session=None, decision=None, expect_s=0.0, **_) -> None:
        store = self.store
        if store is None or session not in self.sessions:
            return
        # All its blocks, shared ones too (unlike an offload): the session's task reads them all.
        where = {h: store.where(h) for h in self.sessions.by_session[session]}
        # Before the move: the rebalance each promotion triggers must already see them expected.
        store.expect([h for h, t in where.items() if t is not None], expect_s)
        hashes = [h for h, t in where.items() if t in LOWER]
        tier = "disk" if any(where[h] == "disk" for h in hashes) else "host"
        nbytes = sum(store.size_of(h) for h in hashes)
        t0 = time.perf_counter()
        fut = store.prefetch(hashes)

        def finished(f) -> None:  # on the store's mover
            moved = f.result() if f.exception() is None else 0
            self._moved("prefetch", session, decision, tier, moved, nbytes, time.perf_counter() - t0)

        fut.add_done_callback(finished)

    async def _invalidate(self, sessions=()) -> dict:
        """Drop what each of ``sessions`` alone kept: ``{session: answer}`` (the scheduler
        sends the sessions that ended together in one call)."""
        return {sid: await self._invalidate_one(sid) for sid in sessions}

    async def _invalidate_one(self, session) -> dict:
        """Drop what ``session`` alone kept, in every tier; never raises for an unknown session.

        Idempotent: a retried call finds nothing left to drop and answers zeros.
        """
        store = self.store
        if session is not None and session not in self.ended:
            self.ended[session] = None
            while len(self.ended) > ENDED_KEPT:
                self.ended.pop(next(iter(self.ended)))
        hashes = self.sessions.pop(session)
        if store is None:
            return {"freed": 0, "left": 0, "shared": 0, "blocks": 0}
        store.release(("session", session))
        alone = [h for h in hashes if not self.sessions.held_by_any(h)]
        # Deleting spill files is disk I/O: off the event loop.
        freed = await asyncio.to_thread(store.discard, alone) if alone else 0
        left = shared = 0
        stays = []
        for h in hashes:
            if h not in store:
                continue
            # Kept by another live session or a live ref: shared; only a running task's pin leaves one.
            if h in store.holds:
                shared += store.size_of(h)
            else:
                left += store.size_of(h)
            if not self.sessions.held_by_any(h):
                stays.append(h)  # a live ref's or a running task's: it goes once they let go
        if stays:
            self._leave(stays)
        self.counters["invalidations"] += 1
        self.counters["invalidated_bytes"] += freed
        return {"freed": freed, "left": left, "shared": shared, "blocks": len(hashes)}

    def _done(self, action: str, session: str, decision, **outcome) -> None:
        if self._reporter is not None and self.worker.batched_stream is not None:
            self.worker.batched_stream.send(
                {"op": LIFECYCLE_DONE, "action": action, "session": session, "decision": decision, **outcome}
            )

    # -- the periodic report ---------------------------------------------------------
    def _changes(self, store) -> tuple:
        """What changes with any session's bytes per tier: blocks in or out, moves between tiers."""
        c = store.counters
        moves = c["device"]["spills"] + c["device"]["unspills"] + c["host"]["spills"] + c["host"]["unspills"]
        return (self.sessions.version, store.version, moves)

    async def _report(self) -> None:
        self._attach()
        store = self.store
        stream = self.worker.batched_stream
        if store is None or stream is None or stream.comm is None or stream.comm.closed():
            return
        if not self._probed:  # the kvstate plugin came after this one: probe now, once, off the loop
            self._probed = True
            self.rates = await asyncio.to_thread(self._probe)
        changes = self._changes(store)
        if changes != self._counted:
            by_session, count = self.sessions.snapshot()
            self._session_bytes = await asyncio.to_thread(tier_bytes, store, by_session, count)
            self._counted = changes
        msg = {
            "sessions": self._session_bytes,
            "rates": self.rates.as_dict(),
            "device": {"bytes": int(store.device.total_weight), "capacity": int(store.device.n)},
            "host": {"bytes": int(store.host.total_weight), "capacity": int(store.host.n)},
        }
        if msg != self._sent and stream.comm is not None and not stream.comm.closed():
            self._sent = msg
            stream.send({"op": LIFECYCLE_REPORT, **msg})

    def stats(self) -> dict:
        return {
            **dict(self.counters),
            "sessions": len(self.sessions),
            "leftover_blocks": len(self.leftovers),
            "rates": self.rates.as_dict(),
        }
