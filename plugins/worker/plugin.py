"""The ``kvstate`` worker plugin: one backend and one block store per worker.

Thin by design (dask_cuda/plugins.py): ``__init__`` validates and stores picklable
settings, ``setup`` does the work. It also

* refcounts blocks by the refs this worker holds: when a key whose value is a
  :class:`KVStateRef` (or a list of them) enters memory its blocks are pinned, when the
  key leaves memory (Dask forgot it) the pins go, through the ``transition`` hook;
* pins a running task's blocks until it finishes, so they never vanish mid-use, and
  tells each of ``task_listeners`` (``fn(key, hashes)``) which blocks the task pinned,
  i.e. computed, pulled, recomputed or read, just before the pins go (the lifecycle
  worker half keeps them as the task's session's);
* serves blocks to peers (:data:`~dask_kvstate.protocol.GET_BLOCKS`) and evictions
  (:data:`~dask_kvstate.protocol.EVICT`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import Counter
from typing import TYPE_CHECKING

import dask.config
from dask.system import CPU_COUNT
from distributed import WorkerPlugin
from distributed.protocol import to_serialize
from distributed.utils import sync
from tornado.ioloop import PeriodicCallback

from dask_kvstate import config
from dask_kvstate.backends import check_backend, check_supported
from dask_kvstate.plugins.worker import checksum, ref_copies
from dask_kvstate.plugins.worker.allocator import retain_freed_memory
from dask_kvstate.plugins.worker.handshake import hello
from dask_kvstate.plugins.worker.memory import KVStateSpillData
from dask_kvstate.plugins.worker.packing import PackingBuffers
from dask_kvstate.plugins.worker.patches import MEMORY_DATA, PATCHES, SPILL
from dask_kvstate.plugins.worker.reporter import StatsReporter
from dask_kvstate.plugins.worker.serve import send_reply, serve_blocks, serve_inline, serve_run
from dask_kvstate.plugins.worker.settings import WorkerSettings, warn_overridden
from dask_kvstate.plugins.worker.transport import call
from dask_kvstate.protocol import (
    BLOCKS,
    EVICT,
    GET_BLOCKS,
    METRICS,
    OBSERVE_EXTENSION,
    PLACEMENT_EXTENSION,
    REF,
    WORKER_PLUGIN,
)
from dask_kvstate.state import KVStateRef, refs_in

if TYPE_CHECKING:
    from dask_kvstate.plugins.worker.runtime import StateRuntime

logger = logging.getLogger("dask_kvstate")

_RUNNING = ("executing", "long-running", "cancelled", "resumed")


class KVStateWorkerPlugin(WorkerPlugin):
    """Load a model and hold KV blocks on every worker.

    Parameters
    ----------
    model : str or list of str, optional
        a known model name (``kvstate.backends.KNOWN_MODELS``), a local model folder or ``.gguf`` file (default
        ``kvstate.model``); a list loads several, the first being the default for
        calls that name none. Unknown names raise ValueError listing the known ones.
    backend : str, optional
        What computes: ``"hf"`` (transformers) or ``"vllm"`` (default ``kvstate.backend``).
    torch_threads : int, optional
        ``torch.set_num_threads`` on the worker (default ``kvstate.worker.torch-threads``).
    device_bytes, host_bytes, disk_bytes : int or str, optional
        Byte budgets of the block store's tiers (default ``kvstate.worker.*-bytes``).

    The client's ``kvstate.*`` config travels with the plugin, so every worker hashes
    blocks with the same block size and namespace rules.
    """

    name = WORKER_PLUGIN
    #: ``config`` read on the worker at setup, what the runtime and the serve side act on
    worker_settings: WorkerSettings

    def __init__(
        self,
        model: str | list[str] | None = None,
        *,
        backend: str | None = None,
        torch_threads: int | None = None,
        device_bytes: int | str | None = None,
        host_bytes: int | str | None = None,
        disk_bytes: int | str | None = None,
    ):
        # A bad key fails here, on the client (or in the preload), not later in a task.
        config.check(dask.config.get("kvstate"))
        names = [model] if isinstance(model, str) or model is None else list(model)
        kind = check_backend(backend if backend is not None else config.get("backend"))
        # What the backend refuses (on vLLM, a model whose every layer slides) fails here, before any worker loads it.
        self.models = tuple(dict.fromkeys(check_supported(m or config.get("model"), kind) for m in names or [None]))
        torch_threads = torch_threads if torch_threads is not None else config.get("worker.torch-threads")
        if torch_threads is not None and (not isinstance(torch_threads, int) or torch_threads < 1):
            raise ValueError(f"torch_threads must be a positive int or None, got {torch_threads!r}")
        self.torch_threads = torch_threads
        self.budgets = {
            name: config.get_bytes(f"worker.{name.replace('_', '-')}", value)
            for name, value in (("device_bytes", device_bytes), ("host_bytes", host_bytes), ("disk_bytes", disk_bytes))
        }
        self.config = {"kvstate": dask.config.get("kvstate")}
        # task results holding refs up to this size ride with their ref report (ref_copies.py)
        self.ref_copy_bytes = config.get_bytes("placement.ref-copy-bytes")
        if backend is not None:
            self.config["kvstate"] = {**self.config["kvstate"], "backend": kind}
        self.placement = False  # whether the scheduler runs the placement extension
        self.runtime: StateRuntime | None = None  # of the default (first) model
        self.runtimes: dict[str, StateRuntime] = {}  # model name -> its runtime, all sharing one block store
        self.held: dict = {}  # key -> state ids pinned for it
        self._lock = threading.Lock()  # transitions run on the event loop, evict in a task thread
        self.task_listeners: list = []  # fn(key, hashes) per finished task that pinned blocks

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "task_listeners")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self.task_listeners = []

    def settings(self) -> dict:
        return {"models": list(self.models), "torch_threads": self.torch_threads, **self.budgets, "config": self.config}

    async def setup(self, worker) -> None:
        # Loading a model takes seconds; keep the event loop (heartbeats, comms) free.
        loop = asyncio.get_running_loop()
        self.worker = worker
        warn_overridden(self.config)
        self.worker_settings = settings = WorkerSettings.from_config(self.config)
        self.runtimes = await loop.run_in_executor(None, self._build, worker, settings)
        self.runtime = self.runtimes[self.models[0]]
        for rt in self.runtimes.values():
            rt.backend.on_engine_death(self._engine_died)  # a backend that drives an engine thread calls it
        self.packing = PackingBuffers(settings.packing_bytes)
        worker.handlers[GET_BLOCKS] = self._serve_blocks
        worker.handlers[EVICT] = self._evict_handler
        ref_copies.serve(worker)  # before the hello: the scheduler may send copies from then on
        if settings.memory_monitor:
            store = self.runtime.store
            PATCHES.install(worker, SPILL, {MEMORY_DATA: lambda data: KVStateSpillData(data, store)}, owner=self)
        self._sent_blocks: set[bytes] = set()
        self._sent_version = -1
        self._sent_metrics: dict | None = None
        self._reporter = None
        extensions = await hello(worker, self.name)
        self.placement = PLACEMENT_EXTENSION in extensions  # report only to a placement extension
        if self.placement:
            self._reporter = PeriodicCallback(self.report_to_placement, settings.placement_report_interval * 1000)
            self._reporter.start()
            self.report_to_placement()  # the probe's numbers, before the first task can need them
        # Stats for the dashboard page, pushed only to a scheduler running the observe extension.
        self._observer = StatsReporter.start(worker, self, extensions.get(OBSERVE_EXTENSION))
        logger.info("kvstate: %s ready on %s", ", ".join(self.models), worker.address)

    def _engine_died(self, error: BaseException) -> None:
        """A backend's engine stopped for good (its waiting tasks already failed with ``error``):
        the worker's nanny restarts it with a fresh engine, or, with no nanny, the worker
        leaves the cluster; either way Dask runs its work elsewhere. Called from the
        engine's own thread."""
        worker = self.worker
        logger.error("kvstate: %s restarts or leaves the cluster: %s", worker.address, error)
        worker.loop.add_callback(self._restart_or_leave, f"kvstate-engine-died: {error}")

    async def _restart_or_leave(self, reason: str) -> None:
        worker = self.worker
        if worker.nanny is None:
            await worker.close(reason=reason)
            return
        # The nanny kills this process and starts a fresh one: the call does not come back.
        with contextlib.suppress(Exception):
            async with worker.rpc(worker.nanny) as nanny:
                await nanny.restart(reason=reason)

    def runtime_for(self, model: str | None = None):
        """The runtime of ``model`` (the default one for None); ValueError if not loaded here."""
        if model is None:
            return self.runtime
        rt = self.runtimes.get(model)
        if rt is None:
            raise ValueError(
                f"model {model!r} is not installed on worker {self.worker.address}; installed: "
                f"{', '.join(self.models)}. Pass every model a graph uses to kvs.install(client, model=[...])"
            )
        return rt

    def _build(self, worker, settings: WorkerSettings):
        import torch

        from dask_kvstate.backends import load_backend
        from dask_kvstate.plugins.worker.block_store import TieredBlockStore
        from dask_kvstate.plugins.worker.runtime import StateRuntime

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        if settings.malloc_retain is not None:
            retain_freed_memory(settings.malloc_retain)
        with dask.config.set(self.config):  # loading reads the model cache and progress settings
            backends = [load_backend(m) for m in self.models]
        # One store for every model: block hashes carry the model identity.
        store = TieredBlockStore(
            os.path.join(worker.local_directory, "kvstate-blocks"),
            **self.budgets,
            half_life_s=settings.recency_half_life,
            device=backends[0].device,
        )
        counters: Counter[str] = Counter()
        runtimes = {b.name: StateRuntime(b, store, worker, counters=counters, settings=settings) for b in backends}
        for rt in runtimes.values():  # seed each model's prefill cost model on this worker
            rt.probe(settings.probe_tokens)
        return runtimes

    def report_to_placement(self) -> None:
        """Tell the scheduler's placement extension what changed here (blocks, measurements)."""
        rt = self.runtime
        stream = self.worker.batched_stream
        # A closed stream (scheduler gone, worker closing) would raise from send() on
        # every tick; the next connection's stream gets a fresh report.
        if rt is None or stream is None or stream.comm is None or stream.comm.closed():
            return
        if rt.store.version != self._sent_version:  # runs every report interval: diff only on change
            self._sent_version = rt.store.version
            current = set(rt.store)
            added, removed = current - self._sent_blocks, self._sent_blocks - current
            if added or removed:
                self.worker.batched_stream.send({"op": BLOCKS, "added": list(added), "removed": list(removed)})
                self._sent_blocks = current
        metrics = {
            "prefill": {
                name: r.prefill_meter.coefficients() for name, r in self.runtimes.items() if r.prefill_meter.obs
            },
            "bandwidth": dict(rt.links.per_peer),
            "seed_bandwidth": rt.links.seed,
            "latency": rt.links.latency,
            "latencies": dict(rt.links.latencies),
            "cores": CPU_COUNT,  # what the host's unclaimed cores are counted against (long prefills borrow them)
        }
        if metrics != self._sent_metrics:
            self.worker.batched_stream.send({"op": METRICS, **metrics})
            self._sent_metrics = metrics

    async def teardown(self, worker) -> None:
        for periodic in (getattr(self, "_reporter", None), getattr(self, "_observer", None)):
            if periodic is not None:
                periodic.stop()
        for name in (GET_BLOCKS, EVICT):
            worker.handlers.pop(name, None)
        PATCHES.remove(worker, SPILL, owner=self)
        runtime, runtimes = self.runtime, list(self.runtimes.values())
        self.runtime = None
        self.runtimes = {}
        self.held.clear()
        if runtime is not None:
            runtime.store.close()
        # An engine holding threads and memory (the vLLM backend) closes off the event loop:
        # vLLM's shutdown runs two full garbage collections, and a worker whose loop it held
        # missed the reply to a heartbeat in flight, logging an error at every close.
        for rt in runtimes:
            await asyncio.to_thread(rt.backend.close)

    # -- refcounts -----------------------------------------------------------------
    def transition(self, key, start, finish, **kwargs) -> None:
        # Dask calls this for every transition of every task, KV or not: each
        # branch below starts with a check that costs a dict lookup or less, and takes no
        # lock for a task that holds or pins nothing.
        rt = self.runtime
        if rt is None:
            return
        try:
            if finish == "memory" and self._may_hold_refs(key):
                value = self.worker.data.get(key)
                refs = refs_in(value)
                with self._lock:
                    for ref in refs:
                        rt.store.hold(("ref", key, ref.state_id), ref.blocks)
                    if refs:
                        self.held[key] = [r.state_id for r in refs]
                if refs and start == "executing" and self.placement:  # computed here: the extension wants it
                    self._send_ref(key, refs[0], value)
                observer = getattr(self, "_observer", None)
                if refs and start == "executing" and observer is not None:
                    observer.send_states(key, refs)
            elif start == "memory" and key in self.held:
                with self._lock:
                    for sid in self.held.pop(key, ()):
                        rt.store.release(("ref", key, sid))
        finally:
            # After the hold above, so a finished task's new blocks are never unprotected;
            # and whatever the reports above raised, so a finished task never keeps its pins.
            # A cancelled task's thread runs on until cancelled -> released; a seceded one
            # (long-running) still runs: keep their pins until then. Only tasks that pinned
            # blocks (kvstate operators) have anything to unpin.
            if start in _RUNNING and finish not in _RUNNING and rt.store.pinned_by(("task", key)):
                used = rt.store.pins.by_owner.get(("task", key), ())
                for listener in self.task_listeners:
                    try:
                        listener(key, used)
                    except Exception:  # a listener's bug must not keep the blocks pinned
                        logger.exception("kvstate: task listener %r failed for %s", listener, key)
                rt.store.unpin(("task", key))

    def _send_ref(self, key, ref: KVStateRef, value) -> None:
        """Tell the placement extension where ``key``'s state lives, and what ``value`` is
        when it is small (:mod:`~dask_kvstate.plugins.worker.ref_copies`). Never raises: a
        closed stream (the scheduler gone) loses the report, as it loses every other message."""
        from distributed.comm.core import CommClosedError

        summary = {
            "blocks": list(ref.blocks),
            "num_tokens": ref.num_tokens,
            "block_tokens": ref.block_tokens,
            "bytes_per_token": ref.nbytes // max(ref.num_tokens, 1),
            "holder": ref.placement.worker,
            "model": ref.model_name,
        }
        stream = self.worker.batched_stream
        if stream is None:
            return
        try:
            copy = ref_copies.pack(value, self.ref_copy_bytes)
            stream.send({"op": REF, "key": key, "refs": [summary], "copy": copy})
        except CommClosedError:
            logger.debug("kvstate: scheduler stream closed; ref report for %s not sent", key)
            return
        if summary["holder"] == self.worker.address:
            # The extension now lists these blocks here: count them as reported, so the next
            # block report says so if they left before it (released, then dropped).
            self._sent_blocks.update(ref.blocks)
            self._sent_version = -1

    def _may_hold_refs(self, key) -> bool:
        # Only look at values whose type can hold refs: reading any other key's value
        # could unspill a large result on the event loop.
        ts = self.worker.state.tasks.get(key)
        return ts is not None and ts.type in (KVStateRef, list, tuple) and key in self.worker.data

    def owners_of(self, state_id: str) -> list:
        return [("ref", key, state_id) for key, sids in self.held.items() if state_id in sids]

    def evict(self, ref: KVStateRef) -> int:
        """Drop ``ref``'s blocks here unless another live state still uses them."""
        if self.runtime is None:  # torn down: the blocks went with the store
            return 0
        with self._lock:
            owners = self.owners_of(ref.state_id)
            for key in {o[1] for o in owners}:
                self.held[key] = [s for s in self.held[key] if s != ref.state_id]
            return self.runtime.evict(ref, owners)

    def evict_everywhere(self, ref: KVStateRef) -> int:
        """:meth:`evict` here, then on ``ref``'s holder; the bytes freed on both. From a task thread.

        A holder that is gone is skipped: its blocks went with it.
        """
        freed = self.evict(ref)
        holder = ref.placement.worker
        if holder and holder != self.worker.address:
            with contextlib.suppress(OSError, TimeoutError):
                freed += sync(
                    self.worker.loop,
                    call,
                    self.worker.rpc,
                    holder,
                    EVICT,
                    state=to_serialize(ref),
                    connect_timeout=self.worker_settings.connect_timeout,
                    timeout=self.worker_settings.pull_timeout,
                )
        return freed

    # -- handlers ------------------------------------------------------------------
    async def _serve_blocks(self, comm=None, hashes=(), serializers=None):
        if self.runtime is None:
            return serve_blocks(None, hashes)
        # Serve on the event loop, as Worker.get_data does, unless blocks must be read
        # and checked from disk, many small blocks packed (a copy) or many bytes
        # checksummed: those go to a thread past Dask's own offload threshold. The
        # thread hop costs a few ms per pull.
        settings = self.worker_settings
        store, packing = self.runtime.store, self.packing if self.packing.keep_bytes else None
        counters = self.runtime.counters
        # One run of memory (an arena) goes out as it is: no copy.
        reply = serve_run(store, hashes) if settings.zero_copy else None
        if reply is not None:
            counters["served_zero_copy"] += 1
            inline = not settings.checksum or checksum.nbytes(reply["frames"]) <= settings.inline_copy_bytes
        else:
            counters["served_packed"] += 1
            read_all = packing is not None or settings.checksum
            inline = serve_inline(store, hashes, settings.inline_copy_bytes, read_all)

        def finish(reply: dict | None) -> dict:
            if reply is None:
                reply = serve_blocks(store, hashes, packing, zero_copy=False)
            return checksum.sign(reply) if settings.checksum else reply

        reply = finish(reply) if inline else await asyncio.to_thread(finish, reply)
        # A reply packed into a lent buffer is written here, so the buffer is given back
        # only once the comm has written it.
        return await send_reply(comm, reply, packing, serializers)

    async def _evict_handler(self, comm=None, state=None) -> int:
        if self.runtime is None or not isinstance(state, KVStateRef):
            return 0
        return self.evict(state)
