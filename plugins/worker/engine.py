"""One model's KV on one worker: what resolving, deciding and the operators share.

A :class:`KVEngine` holds references to the backend, the worker's block store (shared
by every model on the worker: block hashes carry the model identity), the worker, its
settings, its counters and the meters behind the transfer-or-recompute rule. Its
methods are the steps every operator is made of: hash token ids into a block table,
prefill (metered, with the idle threads of other workers on the host for a long one),
cut KV into blocks and store them, and name the new state.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch
from dask.system import CPU_COUNT

from dask_kvstate.blocks import BlockKV, block_hashes, chain_root, kv_tokens, parent_of
from dask_kvstate.plugins.worker import scheduler_link
from dask_kvstate.plugins.worker.accounting import LiveKV
from dask_kvstate.plugins.worker.arena import blocks_to_store
from dask_kvstate.plugins.worker.measure import LinkMeter, PrefillMeter, dask_bandwidth
from dask_kvstate.plugins.worker.partial_match import BlockChildren
from dask_kvstate.plugins.worker.settings import WorkerSettings
from dask_kvstate.state import KVStateRef, Lineage, Placement, new_state_id

if TYPE_CHECKING:
    from dask_kvstate.backends.base import Backend


class KVEngine:
    """A backend, a block store and the worker's comm pool, with this worker's settings.

    ``settings`` default to the current config (for a runtime used without a worker
    plugin, as benchmarks do); ``counters`` may be shared by the engines of several
    models on one worker.
    """

    def __init__(
        self,
        backend: Backend,
        store,
        worker=None,
        counters: Counter | None = None,
        settings: WorkerSettings | None = None,
    ):
        self.backend: Backend = backend
        self.store = store
        self.worker = worker
        self.address = worker.address if worker is not None else None
        self.settings = settings if settings is not None else WorkerSettings.from_config()
        self.block_tokens = self.settings.block_tokens
        self.prefill_meter = PrefillMeter()
        # Seeded with Dask's own estimates (or the emulated link, when one is configured)
        # until real pulls are measured: its measurement of a peer's link where it made
        # one, its global bandwidth estimate otherwise.
        seed = getattr(worker, "bandwidth", None) or 1e8
        emulated = self.settings.emulated_bandwidth
        self.links = LinkMeter(
            seed_bandwidth=min(seed, emulated or seed),
            latency=max(getattr(worker, "latency", 0.0) or 0.0, 1e-3),
            seeds=None if worker is None or emulated else functools.partial(dask_bandwidth, worker),
        )
        self.counters: Counter[str] = Counter() if counters is None else counters
        self.live = LiveKV(store, self.counters)
        self.children = BlockChildren()  # the blocks this engine stored, by parent, with their tokens

    def hashes(self, ids: Sequence[int], namespace: str) -> tuple[bytes, ...]:
        """The block table of ``ids`` under this model and ``namespace``."""
        return block_hashes(ids, identity=self.backend.kv_identity, namespace=namespace, block_tokens=self.block_tokens)

    def root(self, namespace: str) -> bytes:
        """The parent of the first block of every chain of this model under ``namespace``."""
        return chain_root(self.backend.kv_identity, namespace)

    def stored_past(self, ids: Sequence[int], hashes: tuple[bytes, ...], namespace: str) -> tuple[int, BlockKV]:
        """What a call on prompt ``ids`` (block table ``hashes``) reuses of what this worker
        stores: how many of its leading blocks are stored whole, and the KV it computes over
        (no blocks when none is worth it, :meth:`Backend.worth_reusing`). That is those blocks,
        then the leading tokens of a stored block the prompt leaves the chain in, as many as
        it shares with it (:mod:`.partial_match`), and never the prompt's last token: its
        logits start decoding. The partial block is pinned beside whatever the caller pinned."""
        present = []
        for h in hashes:
            t = self.store.get(h)
            if t is None:
                break
            present.append(t)
        whole = len(present)
        self.counters["block_hits"] += whole
        if whole < len(hashes):
            tail = self._partial_block(ids, hashes, whole, namespace)
            if tail is not None:
                present.append(tail)
        device = self.backend.device
        past = BlockKV(tuple(t.to(device, non_blocking=True) for t in present)).head(len(ids) - 1)
        if past.blocks and not self.backend.worth_reusing(past.tokens, len(ids)):
            self.counters["declined_reuse_tokens"] += past.tokens
            return whole, BlockKV(())
        inside = past.tokens - whole * self.block_tokens
        if inside > 0:
            self.counters["partial_block_hits"] += 1
            self.counters["partial_block_tokens"] += inside
        return whole, past

    def _partial_block(self, ids: Sequence[int], hashes: tuple[bytes, ...], i: int, namespace: str):
        """The leading tokens of the stored block sharing the most with the prompt's block ``i``, or None.

        Read and pinned only if a past that long is worth reusing (:meth:`Backend.worth_reusing`):
        else the call would read a block (from disk, maybe) to throw it away, and its session
        would hold the block of whichever prompt began alike (another document's header).
        """
        want = ids[i * self.block_tokens : (i + 1) * self.block_tokens]
        for child, shared in self.children.matches(parent_of(hashes, i, self.root(namespace)), want):
            reused = min(i * self.block_tokens + shared, len(ids) - 1)
            if not self.backend.worth_reusing(reused, len(ids)):
                # The longest match comes first, so no other is worth it; the whole blocks
                # before it are declined, and counted, by the caller.
                self.counters["declined_reuse_tokens"] += reused - i * self.block_tokens
                return None
            self.store.pin_more(self.task_owner(), (child,))
            block = self.store.get(child)
            if block is not None:
                self.children.used(child)
                return block[:, :, :, :shared]
            self.children.forget(child)  # it left the store since it was indexed
        return None

    def as_past(self, past: BlockKV) -> torch.Tensor | BlockKV | None:
        """``past`` in the form the backend takes: None when empty; its blocks for a backend with
        a paged cache of its own (joining them would be one more copy, into fresh memory: see
        BlockKV), joined otherwise."""
        if not past.blocks:
            return None
        return past if self.backend.reads_blocks else past.joined()

    def task_owner(self) -> tuple[str, Hashable | None]:
        """Pin owner for blocks in use by the running task (the worker plugin unpins it when the task ends)."""
        return ("task", scheduler_link.current_task(self.worker))

    def new_ref(
        self,
        op: str,
        parents: tuple[str, ...],
        text: str,
        ids: Sequence[int],
        hashes: tuple[bytes, ...],
        namespace: str,
    ) -> KVStateRef:
        """The descriptor of a state this worker just built (and holds)."""
        return KVStateRef(
            state_id=new_state_id(),
            model_name=self.backend.name,
            model=self.backend.model_fingerprint,
            config=self.backend.config_fingerprint,
            namespace=namespace,
            block_tokens=self.block_tokens,
            num_tokens=len(ids),
            blocks=hashes,
            text=text,
            nbytes=len(ids) * self.backend.kv_bytes_per_token,
            lineage=Lineage(op, parents),
            placement=Placement(self.address, self.store.tier),
        )

    def store_kv(
        self,
        kv: torch.Tensor | BlockKV,
        hashes: tuple[bytes, ...],
        first_block: int,
        first_token: int = 0,
        *,
        ids: Sequence[int] | None = None,
        namespace: str | None = None,
    ) -> list:
        """Cut ``kv`` (the KV of tokens ``first_token...``; blocks a backend laid out are
        kept as they are) into blocks ``first_block...``, store them, return their tensors.

        With the chain's ``ids`` and ``namespace``, the blocks are indexed by their tokens
        too, so a later prompt that leaves the chain inside one reuses its leading tokens
        (:mod:`.partial_match`).
        """
        blocks = blocks_to_store(kv, hashes, self.block_tokens, first_block, first_token)
        for block in blocks:
            self.store.put(block.hash, block.tensor)
        if ids is not None and namespace is not None:
            self.children.add_chain(hashes, ids, first_block, self.root(namespace), self.block_tokens)
        return [block.tensor for block in blocks]

    def prefill_and_store(
        self,
        ids: Sequence[int],
        past: torch.Tensor | BlockKV | None,
        hashes: tuple[bytes, ...],
        first_block: int,
        *,
        namespace: str | None = None,
    ) -> list:
        """Prefill ``ids`` over ``past`` (the KV of blocks ``...first_block - 1`` or more) and
        store blocks ``first_block...``; their tensors. Only those blocks' KV is asked of the
        backend (see :meth:`prefill`)."""
        kv, first_token = self.prefill(ids, past, keep_from=first_block * self.block_tokens, namespace=namespace)
        return self.store_kv(kv, hashes, first_block, first_token, ids=ids, namespace=namespace)

    def prefill(
        self,
        ids: Sequence[int],
        past: torch.Tensor | BlockKV | None,
        keep_from: int = 0,
        *,
        namespace: str | None = None,
    ) -> tuple[torch.Tensor | BlockKV, int]:
        """``(kv, first)``: the KV of ``ids`` from token ``first`` on, ``past`` being that of
        their leading tokens; counted and metered.

        ``keep_from`` (a block boundary no later than ``past`` ends) is where the caller's
        use of the KV starts: the tokens before are ``past``'s, already stored. A backend
        that copies KV out of an engine's own cache (vLLM) copies from there on only, so
        ``first`` is ``keep_from`` or earlier; the transformers backend copies out exactly
        from ``keep_from``.
        ``namespace`` is the tenant the prefill is for (an engine with a prefix cache of
        its own keeps tenants apart there).
        """
        past_len = 0 if past is None else kv_tokens(past)
        self.counters["prefill_tokens"] += len(ids) - past_len
        self.counters["reused_tokens"] += past_len
        with self._borrowed_threads(len(ids)) as threads:  # computed, and read as context
            t0 = time.perf_counter()
            cache, _ = self.backend.prefill(list(ids), past, keep_from=keep_from, namespace=namespace)
            seconds = time.perf_counter() - t0
        self._meter_prefill(threads, len(ids) - past_len, past_len, seconds)
        kv = self.backend.kv_to_store(cache, keep_from, self.block_tokens)
        first = len(ids) - kv_tokens(kv)
        if not 0 <= first <= keep_from or first % self.block_tokens:
            raise RuntimeError(
                f"{self.backend.name!r} returned the KV of {kv_tokens(kv)} of {len(ids)} tokens: it must "
                f"start on a block boundary no later than token {keep_from}"
            )
        return kv, first

    def _meter_prefill(self, threads: int, tokens: int, reused: int, seconds: float) -> None:
        """Feed the prefill meter a call that ran on ``threads`` threads: only at this
        worker's own count, the one it predicts recompute time at (a call on borrowed
        threads, or run while another held them, 0, is not fed)."""
        if threads == torch.get_num_threads():
            self.prefill_meter.add(tokens, reused, seconds)

    @contextlib.contextmanager
    def _borrowed_threads(self, tokens: int):
        """Run a long prefill (or a long resume, mostly a batch of siblings) with the idle
        threads of other workers on this host too, and its cores no worker claims.

        A state's prefill is the critical path of every branch that waits on it, and
        while it runs the workers that will run those branches have nothing to do (on
        two cores with one single-threaded worker each, a 4,096-token materialize left
        one core idle for ~18 s); so is a batch of siblings decoding on the state's holder
        while the others wait for it; and a core no worker's threads claim (one worker of
        one thread on two cores) idles all along. The scheduler's placement extension counts
        both; torch's intra-op pool grows by that many for the call and shrinks
        back after. Costs one scheduler round trip, so only calls whose ``tokens`` reach
        ``kvstate.worker.borrow-idle-threads`` ask: the tokens a call runs through the model
        plus those it reads as reused context (a returning session's question over its
        long document attends to, and first loads, every token of it at each step).

        torch's thread count is process-wide: every task thread of this worker would run
        with it. So threads are borrowed only while this worker runs no other task, and
        by one prefill at a time (:data:`_BORROWING`), which also keeps two borrowers
        from restoring each other's counts. Yields the thread count used, or 0 while
        another prefill holds borrowed threads (its count is not this one's to meter).
        """
        if _BORROWING.locked():
            yield 0  # another prefill has the process's thread count raised right now
            return
        least = self.settings.borrow_min_tokens
        if self.worker is None or not least or tokens < least or not self.backend.elastic_threads or not self._alone():
            yield torch.get_num_threads()
            return
        if not _BORROWING.acquire(blocking=False):
            yield 0
            return
        try:
            own = torch.get_num_threads()  # read under the lock: nobody's borrowed count
            extra = scheduler_link.idle_threads(self.worker, timeout=self.settings.connect_timeout)
            threads = min(own + max(extra, 0), CPU_COUNT)  # Dask's count: affinity and cgroup limits applied
            if threads <= own:
                yield own
                return
            self.counters["borrows"] += 1
            self.counters["borrowed_threads"] += threads - own
            torch.set_num_threads(threads)
            try:
                yield threads
            finally:
                torch.set_num_threads(own)
        finally:
            _BORROWING.release()

    def _alone(self) -> bool:
        """Whether the running task is the only one on this worker (a seceded task counts: it may compute)."""
        state = getattr(self.worker, "state", None)
        return state is not None and len(state.executing) + len(state.long_running) <= 1


#: Held by the one prefill that may raise torch's process-wide thread count.
_BORROWING = threading.Lock()
