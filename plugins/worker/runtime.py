"""The worker-side engine behind the operators: resolve refs, prefill, resume.

One :class:`StateRuntime` lives in each worker's ``kvstate`` plugin and owns nothing
but references to the backend, the block store and the worker. Every operator task
ends up here.

Resolving a ref (turning metadata into KV tensors on this worker) follows the paper's
rule: local blocks are hits; missing blocks are pulled from the holder; whatever is
still missing (holder gone, holder evicted them, pull failed) is recomputed from the
state's text. An incompatible state (other model, config or tokenizer) is never used:
its text is prefilled from scratch. No path raises because KV went missing, and
every path yields the KV of tokenize(text), so output equals text replay.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch

from dask_kvstate import config
from dask_kvstate.blocks import block_hashes, join_blocks, split_blocks
from dask_kvstate.cost import transfer_or_recompute
from dask_kvstate.errors import MergeError
from dask_kvstate.generation import Generation
from dask_kvstate.plugins.worker.events import worker_event
from dask_kvstate.plugins.worker.measure import LinkMeter, PrefillMeter
from dask_kvstate.plugins.worker.transport import pull_blocks
from dask_kvstate.protocol import (
    COMPATIBILITY_TOPIC,
    IDLE_THREADS,
    OUTCOME,
    PLACEMENT_ANNOTATION,
    STORE_TOPIC,
    WORKER_PLUGIN,
)
from dask_kvstate.state import KVState, KVStateRef, Lineage, Placement, incompatibility, new_state_id

logger = logging.getLogger("dask_kvstate")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Examples
    --------
    >>> common_prefix([1, 2, 3], [1, 2, 4, 5]), common_prefix([], [1])
    (2, 0)
    """
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class StateRuntime:
    """Operators on one worker: a backend, a block store and the worker's comm pool."""

    def __init__(self, backend, store, worker=None, counters: Counter | None = None):
        self.backend = backend
        self.store = store
        self.worker = worker
        self.address = worker.address if worker is not None else None
        self.block_tokens = int(config.get("block-tokens"))
        self.connect_timeout = config.get_seconds("transport.connect-timeout")
        self.pull_timeout = config.get_seconds("transport.timeout")
        self.emulated_bandwidth = config.get_bandwidth("transport.emulated-bandwidth")
        self.rule = config.get("placement.rule")
        self.borrow_min_tokens = int(config.get("worker.borrow-idle-threads"))
        self.prefill_meter = PrefillMeter()
        # Seeded with Dask's own estimate (or the emulated link, when one is configured)
        # until real pulls are measured.
        seed = getattr(worker, "bandwidth", None) or 1e8
        self.links = LinkMeter(
            seed_bandwidth=min(seed, self.emulated_bandwidth or seed),
            latency=max(getattr(worker, "latency", 0.0) or 0.0, 1e-3),
        )
        self.counters: Counter[str] = Counter() if counters is None else counters
        self._live_bytes = 0  # KV in decode caches now (see live_kv)
        self._live_lock = threading.Lock()
        self._resolve_guard = threading.Lock()
        self._resolve_locks: dict[tuple[bytes, ...], tuple[threading.Lock, int]] = {}

    # -- helpers -------------------------------------------------------------------
    def hashes(self, ids: Sequence[int], namespace: str) -> tuple[bytes, ...]:
        return block_hashes(ids, identity=self.backend.kv_identity, namespace=namespace, block_tokens=self.block_tokens)

    def _task_owner(self) -> Hashable:
        """Pin owner for blocks in use by the running task (released by the plugin)."""
        key = None
        if self.worker is not None:
            try:
                key = self.worker.get_current_task()
            except KeyError:  # not inside a task (direct use from tools)
                key = None
        return ("task", key)

    def _new_ref(
        self,
        op: str,
        parents: tuple[str, ...],
        text: str,
        ids: Sequence[int],
        hashes: tuple[bytes, ...],
        namespace: str,
    ) -> KVStateRef:
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

    def _store_kv(self, kv: torch.Tensor, hashes: tuple[bytes, ...], first_block: int) -> list[torch.Tensor]:
        """Cut ``kv`` into blocks ``first_block...``, store them, return their tensors."""
        blocks = split_blocks(kv, hashes, self.block_tokens, first_block)
        for block in blocks:
            self.store.put(block.hash, block.tensor)
        return [block.tensor for block in blocks]

    def _prefill(self, ids: Sequence[int], past: torch.Tensor | None) -> torch.Tensor:
        past_len = 0 if past is None else past.shape[3]
        self.counters["prefill_tokens"] += len(ids) - past_len
        self.counters["reused_tokens"] += past_len
        with self._borrowed_threads(len(ids) - past_len) as threads:
            t0 = time.perf_counter()
            cache, _ = self.backend.prefill(list(ids), past)
            seconds = time.perf_counter() - t0
        if threads == torch.get_num_threads():
            # The meter predicts recompute time at this worker's own thread count.
            self.prefill_meter.add(len(ids) - past_len, past_len, seconds)
        return self.backend.kv_from_cache(cache)

    @contextlib.contextmanager
    def _borrowed_threads(self, tokens: int):
        """Run a long prefill with the idle threads of other workers on this host too.

        A state's prefill is the critical path of every branch that waits on it, and
        while it runs the workers that will run those branches have nothing to do (on
        two cores with one single-threaded worker each, a 4,096-token materialize left
        one core idle for ~18 s). The scheduler's placement extension counts the idle
        threads; torch's intra-op pool grows by that many for the prefill and shrinks
        back after. Yields the thread count used. Costs one scheduler round trip, so only
        prefills of ``kvstate.worker.borrow-idle-threads`` tokens or more ask.
        """
        own = torch.get_num_threads()
        extra = 0
        if self.worker is not None and self.borrow_min_tokens and tokens >= self.borrow_min_tokens:
            from distributed.utils import sync

            try:
                extra = int(
                    sync(
                        self.worker.loop,
                        getattr(self.worker.scheduler, IDLE_THREADS),
                        worker=self.address,
                        callback_timeout=self.connect_timeout,
                    )
                )
            except Exception as e:  # no placement extension, a scheduler away: just don't borrow
                logger.debug("kvstate: not borrowing threads (%s)", e)
        threads = min(own + max(extra, 0), os.cpu_count() or own)
        if threads <= own:
            yield own
            return
        self.counters["borrowed_threads"] += threads - own
        torch.set_num_threads(threads)
        try:
            yield threads
        finally:
            torch.set_num_threads(own)

    # -- resolve -------------------------------------------------------------------
    def resolve(self, ref: KVStateRef) -> KVState:
        """``ref`` with its token ids and KV on this worker (``kv`` None if unusable here).

        Never raises for missing blocks, dead holders or incompatible states.
        """
        if not isinstance(ref, KVStateRef):
            raise TypeError(
                f"expected a KVStateRef (the result of kvs.materialize/extend/fork), got {type(ref).__name__}"
            )
        ids = self.backend.tokenize(ref.text)
        why = incompatibility(ref, model=self.backend.model_fingerprint, config=self.backend.config_fingerprint)
        if why is None and (len(ids) != ref.num_tokens or self.hashes(ids, ref.namespace) != ref.blocks):
            why = "its block table does not match the tokens of its text"
        if why is not None:
            self.counters["incompatible"] += 1
            logger.info("kvstate: not reusing state %s (%s); recomputing from text", ref.state_id[:8], why)
            # One event per refusal: rare by nature, and each names a state a user may be debugging.
            worker_event(
                self.worker,
                COMPATIBILITY_TOPIC,
                {
                    "kind": "refused",
                    "state": ref.state_id,
                    "model": ref.model_name,
                    "here": self.backend.name,
                    "tokens": ref.num_tokens,
                    "reason": why,
                },
            )
            return KVState(ref, ids, None)
        if not ids:
            return KVState(ref, ids, None)
        self.store.pin(self._task_owner(), ref.blocks)
        # One resolve of a block table at a time on this worker: concurrent resumes of one
        # state (sibling batches on a worker with several threads) would each pull or
        # recompute the missing blocks and each keep a joined copy; the later ones now
        # find the first's blocks, adopted, and join them to a view.
        with self._resolving(ref.blocks):
            return KVState(ref, ids, self._fill(ref, ids))

    @contextlib.contextmanager
    def _resolving(self, blocks: tuple[bytes, ...]):
        with self._resolve_guard:
            lock, users = self._resolve_locks.get(blocks, (None, 0))
            lock = lock or threading.Lock()
            self._resolve_locks[blocks] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._resolve_guard:
                lock, users = self._resolve_locks[blocks]
                if users == 1:
                    del self._resolve_locks[blocks]
                else:
                    self._resolve_locks[blocks] = (lock, users - 1)

    def _fill(self, ref: KVStateRef, ids: list[int]) -> torch.Tensor:
        """The KV of ``ref``'s blocks on this worker as one tensor: held, pulled or recomputed."""
        tensors = [self.store.get(h) for h in ref.blocks]
        missing = [h for h, t in zip(ref.blocks, tensors) if t is None]
        self.counters["block_hits"] += len(tensors) - len(missing)
        holder = ref.placement.worker
        decision = None
        if missing and self.worker is not None and holder not in (None, self.address):
            decision = self._decide(ref, tensors, holder)
            if decision["action"] == "pull":
                t0 = time.perf_counter()
                pulled = self._pull(holder, missing)
                decision["seconds"] = time.perf_counter() - t0
                tensors = [pulled.get(h, t) if t is None else t for h, t in zip(ref.blocks, tensors)]
        first_missing = next((i for i, t in enumerate(tensors) if t is None), None)
        if first_missing is not None:
            t0 = time.perf_counter()
            tensors = self._recompute(ids, ref.blocks, tensors, first_missing)
            if decision is not None and decision["action"] == "recompute":
                decision["seconds"] = time.perf_counter() - t0
        if decision is not None and "seconds" in decision:
            self._outcome(decision)
        device = self.backend.device  # a block read back from a lower tier may sit in host memory
        kv = join_blocks([t.to(device, non_blocking=True) for t in tensors])
        if len(tensors) > 1 and not _same_storage(kv, tensors[0]):
            # Keep the joined copy as the blocks' storage: one copy of the state here, not two.
            self.counters["adopted_blocks"] += self.store.adopt(ref.blocks, kv, self.block_tokens)
        return kv

    # -- transfer or recompute -------------------------------------------------------
    def _decide(self, ref: KVStateRef, tensors: list, holder: str) -> dict:
        """Pull the missing blocks from ``holder`` or recompute them (AAFLOW+ eq. 30).

        The scheduler's placement extension decides when it sent this task here for its
        KV (the ``kvstate-placement`` annotation); otherwise (stolen, loose fallback,
        extension off) this worker decides with its own measurements, same rule.
        """
        first = next(i for i, t in enumerate(tensors) if t is None)
        key = self._task_owner()[1]
        ts = self.worker.state.tasks.get(key) if key is not None else None
        ann = ((ts.annotations or {}).get(PLACEMENT_ANNOTATION) if ts is not None else None) or {}
        d = self._rule(ref, first, holder)
        if ann.get("worker") == self.address and ann.get("action") in ("pull", "recompute"):
            d.update(action=ann["action"], t_transfer=ann["t_transfer"], t_recompute=ann["t_recompute"], by="scheduler")
        if self.rule in ("pull", "recompute"):
            d.update(action=self.rule, by="config")
        self.counters[f"chose_{d['action']}"] += 1
        return {**d, "key": key, "holder": holder}

    def _rule(self, ref: KVStateRef, first: int, holder: str) -> dict:
        """The rule with this worker's measurements, for ``ref`` missing blocks ``first...``."""
        missing_tokens = ref.num_tokens - first * ref.block_tokens
        missing_bytes = missing_tokens * self.backend.kv_bytes_per_token
        per_token, per_pair = self.prefill_meter.coefficients()
        action, tt, tr = transfer_or_recompute(
            missing_bytes,
            missing_tokens,
            first * ref.block_tokens,
            bandwidth=self.links.bandwidth(holder),
            latency=self.links.latency,
            per_token_s=per_token,
            per_pair_s=per_pair,
        )
        return {
            "action": action,
            "t_transfer": tt,
            "t_recompute": tr,
            "by": "worker",
            "missing_bytes": missing_bytes,
            "missing_tokens": missing_tokens,
        }

    def _outcome(self, d: dict) -> None:
        """Count a decision that was slower than the other option's estimate, and tell the scheduler."""
        other = d["t_recompute"] if d["action"] == "pull" else d["t_transfer"]
        if d["seconds"] > other:
            self.counters["slower_choice"] += 1
        plugin = self.worker.plugins.get(WORKER_PLUGIN) if self.worker is not None else None
        if plugin is not None and plugin.placement:
            self.worker.loop.add_callback(self.worker.batched_stream.send, {"op": OUTCOME, **d})

    def estimate(self, ref: KVStateRef) -> dict:
        """What the rule would do for ``ref`` on this worker now, without doing it."""
        first = next((i for i, h in enumerate(ref.blocks) if h not in self.store), None)
        if first is None or ref.placement.worker in (None, self.address):
            return {"action": "local", "t_transfer": 0.0, "t_recompute": 0.0}
        return self._rule(ref, first, ref.placement.worker)

    def measure_fill(self, ref: KVStateRef, action: str) -> float:
        """Seconds to fill ``ref``'s blocks here by ``action`` ("pull" or "recompute"), from
        none held locally; the blocks are dropped again after. For benchmarks of the rule."""
        if action not in ("pull", "recompute"):
            raise ValueError(f"action must be 'pull' or 'recompute', got {action!r}")
        if ref.placement.worker in (None, self.address):
            raise ValueError("measure_fill needs a state held by another worker")
        ids = self.backend.tokenize(ref.text)
        self.store.discard(ref.blocks)
        t0 = time.perf_counter()
        if action == "pull":
            got = self._pull(ref.placement.worker, list(ref.blocks))
            if len(got) != len(ref.blocks):
                raise RuntimeError(f"pull from {ref.placement.worker} returned {len(got)} of {len(ref.blocks)} blocks")
        else:
            self._recompute(ids, ref.blocks, [None] * len(ref.blocks), 0)
        seconds = time.perf_counter() - t0
        self.store.discard(ref.blocks)
        return seconds

    def probe(self, sizes=(32, 256)) -> None:
        """Time a few prefills of this worker's model to seed the prefill cost model."""
        vocab = int(getattr(self.backend.config, "vocab_size", 1000))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (max(sizes),), generator=g).tolist()
        self.backend.prefill(ids[: min(sizes)])  # warm-up: first calls pay one-off kernel setup
        for n in sizes:
            t0 = time.perf_counter()
            self.backend.prefill(ids[:n])
            self.prefill_meter.add(n, 0, time.perf_counter() - t0)

    def _pull(self, holder: str, hashes: list[bytes]) -> dict[bytes, torch.Tensor]:
        from distributed.utils import sync

        try:
            res = sync(
                self.worker.loop,
                pull_blocks,
                self.worker.rpc,
                holder,
                hashes,
                connect_timeout=self.connect_timeout,
                timeout=self.pull_timeout,
                emulated_bandwidth=self.emulated_bandwidth,
            )
        except Exception as e:
            self.counters["transfer_failures"] += 1
            logger.warning(
                "kvstate: pulling %d blocks from %s failed (%s: %s); recomputing",
                len(hashes),
                holder,
                type(e).__name__,
                e,
            )
            return {}
        for h, t in res.blocks.items():  # the store moves them to its device; resolve to the model's
            self.store.put(h, t)
        self.counters["transfers"] += len(res.blocks)
        self.counters["pulls_zero_copy" if res.zero_copy else "pulls_packed"] += 1
        self.counters["transfer_bytes"] += res.nbytes
        self.counters["transfer_seconds"] += res.seconds
        self.links.add(holder, res.nbytes, res.seconds)
        return res.blocks

    def _recompute(self, ids, hashes, tensors, first: int) -> list[torch.Tensor]:
        past = join_blocks(tensors[:first])
        rebuilt = self._store_kv(self._prefill(ids, past), hashes, first)
        self.counters["recomputes"] += len(hashes) - first
        self.counters["recompute_tokens"] += len(ids) - first * self.block_tokens
        return tensors[:first] + rebuilt

    # -- operators -----------------------------------------------------------------
    def materialize(self, text: str, namespace: str) -> KVStateRef:
        """Prefill ``text`` into blocks, reusing any leading blocks already stored here."""
        ids = self.backend.tokenize(text)
        if not ids:
            raise ValueError("cannot materialize an empty prompt: the segments joined to no tokens")
        hashes = self.hashes(ids, namespace)
        self.store.pin(self._task_owner(), hashes)
        present = []
        for h in hashes:
            t = self.store.get(h)
            if t is None:
                break
            present.append(t)
        self.counters["block_hits"] += len(present)
        if len(present) < len(hashes):
            kv = self._prefill(ids, join_blocks(present))
            self._store_kv(kv, hashes, len(present))
        else:
            self.counters["reused_tokens"] += len(ids)
        self.counters["materializations"] += 1
        return self._new_ref("materialize", (), text, ids, hashes, namespace)

    def extend(self, ref: KVStateRef, text: str) -> KVStateRef:
        """``ref`` followed by ``text``: the KV of tokenize(ref.text + text)."""
        full = ref.text + text
        old = self.resolve(ref)
        ids = self.backend.tokenize(full)
        if not ids:
            raise ValueError("cannot extend to an empty prompt")
        hashes = self.hashes(ids, ref.namespace)
        self.store.pin(self._task_owner(), ref.blocks + hashes)
        keep = common_prefix(old.token_ids, ids) if old.usable else 0
        if keep == len(ids):
            kv = old.kv[:, :, :, :keep]
            self.counters["reused_tokens"] += keep
        else:
            kv = self._prefill(ids, old.kv[:, :, :, :keep] if keep else None)
        self._store_kv(kv, hashes, keep // self.block_tokens)
        self.counters["extensions"] += 1
        return self._new_ref("extend", (ref.state_id,), full, ids, hashes, ref.namespace)

    def generate(
        self, text: str, *, max_new_tokens: int, temperature: float, top_p: float, seed: int | None
    ) -> Generation:
        """Text replay: the whole prompt through the model, no state involved."""
        t0 = time.perf_counter()
        ids = self.backend.tokenize(text)
        return self._generate(
            ids, None, t0, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
        )

    def _generate(self, ids: list[int], past: torch.Tensor | None, started: float, **params) -> Generation:
        """Decode from ``ids`` with ``past`` as the KV of their leading tokens; counts and measures."""
        keep = 0 if past is None else int(past.shape[3])
        self.counters["prefill_tokens"] += len(ids) - keep
        self.counters["reused_tokens"] += keep
        with self.live_kv((len(ids) + params["max_new_tokens"]) * self.backend.kv_bytes_per_token):
            res = self.backend.generate(ids, past, started=started, **params)
        self.counters["generations"] += 1
        self.prefill_meter.add(res.prefill_tokens, res.reused_tokens, res.prefill_s)
        return Generation.from_result(self.backend, res, ids)

    def resume(
        self, ref: KVStateRef, text: str, *, max_new_tokens: int, temperature: float, top_p: float, seed: int | None
    ) -> Generation:
        """Generate from ``ref`` followed by ``text``; equals ``generate(ref.text + text)``.

        The state's KV is read in place (shared-prefix attention, ``backends/cascade.py``),
        not copied into a transformers cache.
        """
        return self._resume_rows(
            ref, [text], max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
        )[0]

    def resume_many(
        self,
        ref: KVStateRef,
        texts: Sequence[str],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
    ) -> list[Generation]:
        """Sibling resumes from one state, decoded as one batch; one ``Generation`` per text.

        Each equals ``resume(ref, text)``: the state is resolved once, every sibling's
        suffix is prefilled by one forward and the decode steps run batched, all rows
        reading the state's KV in place (``backends/batch.py``).
        """
        self.counters["batched_resumes"] += len(texts)
        self.counters["resume_batches"] += 1
        return self._resume_rows(
            ref, texts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
        )

    def _resume_rows(
        self,
        ref: KVStateRef,
        texts: Sequence[str],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
    ) -> list[Generation]:
        from dask_kvstate.backends.batch import Row, generate_batch, kv_bytes

        t0 = time.perf_counter()
        old = self.resolve(ref)
        rows = []
        for text in texts:
            ids = self.backend.tokenize(ref.text + text)
            # At least the last prompt token is re-run: its logits start decoding.
            keep = min(common_prefix(old.token_ids, ids), len(ids) - 1) if old.usable else 0
            rows.append(Row(ids, keep, seed))
            self.counters["prefill_tokens"] += len(ids) - keep
            self.counters["reused_tokens"] += keep
        self.counters["resumes"] += len(rows)
        prefix = old.kv if old.usable and any(r.keep for r in rows) else None
        # Held while decoding: the rows' own buffers, plus the state's KV if it is not the
        # store's own memory (blocks on a lower tier, or not adopted).
        live = kv_bytes(self.backend, rows, max_new_tokens)
        held = self.store.peek(ref.blocks[0]) if prefix is not None else None
        if prefix is not None and not _same_storage(prefix, held):
            live += prefix.nbytes
        with self.live_kv(live):
            results = generate_batch(
                self.backend,
                rows,
                prefix,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                started=t0,
            )
        self.counters["generations"] += len(rows)
        out = []
        batch_id = new_state_id()  # rows of one batch share its decode time (decode_s is the batch's)
        for row, res in zip(rows, results):
            self.prefill_meter.add(res.prefill_tokens, res.reused_tokens, res.prefill_s)
            g = Generation.from_result(self.backend, res, row.ids)
            g.batch_id, g.batch_rows = batch_id, len(rows)
            out.append(g)
        return out

    @contextlib.contextmanager
    def live_kv(self, nbytes: int):
        """Count ``nbytes`` of decode-time KV (caches outside the store) while inside.

        ``kv_peak_bytes`` is the most KV this worker held at once: the store's device
        tier plus the caches of generations running then (each at its final size, an
        upper bound when a row stops early at EOS). The benchmarks compare it across
        text replay, the prefix cache and kvstate.
        """
        with self._live_lock:
            self._live_bytes += nbytes
            now = self.store.device.total_weight + self._live_bytes
            self.counters["kv_peak_bytes"] = max(self.counters["kv_peak_bytes"], now)
        try:
            yield
        finally:
            with self._live_lock:
                self._live_bytes -= nbytes

    def fork(self, ref: KVStateRef, k: int) -> list[KVStateRef]:
        """``k`` new states sharing ``ref``'s blocks: O(1), nothing is copied."""
        self.counters["forks"] += k
        return [ref.derive("fork") for _ in range(k)]

    def transfer(self, ref: KVStateRef) -> KVStateRef:
        """Make this worker hold ``ref``'s blocks (pull or recompute) and say so."""
        if not self.resolve(ref).usable:  # incompatible here: rebuilt for this worker's model
            return self.materialize(ref.text, ref.namespace)
        return ref.derive("transfer", placement=Placement(self.address, self.store.tier))

    def merge(self, refs: Sequence[KVStateRef], policy: str) -> KVStateRef:
        """Restricted composition: sequential, prefix-compatible states only (see ``kvs.merge``)."""
        if policy != "concat":
            raise ValueError(f"unknown merge policy {policy!r}; supported: 'concat'")
        if not refs:
            raise ValueError("merge needs at least one state")
        for i, r in enumerate(refs):
            if not isinstance(r, KVStateRef):
                raise TypeError(f"merge argument {i} is a {type(r).__name__}, not a KVStateRef")
        # A state is the prefill of tokenize(its text), so "b continues a" means a's
        # text is a prefix of b's; the token boundary between them is re-checked when
        # the merged state is resumed or extended, as for extend().
        ordered = sorted(refs, key=lambda r: len(r.text))
        for a, b in itertools.pairwise(ordered):
            why = incompatibility(a, model=b.model, config=b.config, namespace=b.namespace)
            if why:
                raise MergeError(
                    f"cannot merge state {a.state_id[:8]} with {b.state_id[:8]}: {why}. Merge only "
                    "states of one model, config and namespace; to combine texts across them, "
                    "kvs.extend one state with the other's text"
                )
            if not b.text.startswith(a.text):
                at = common_prefix(a.text, b.text)
                raise MergeError(
                    f"cannot merge state {a.state_id[:8]} ({a.num_tokens} tokens) with {b.state_id[:8]} "
                    f"({b.num_tokens} tokens): their texts diverge at character {at}. Only sequential, "
                    "non-overlapping concatenation is allowed (each state must continue the previous one, as "
                    "extend() builds); KV of independently prefilled segments attends to different contexts "
                    "and cannot be joined"
                )
        last = ordered[-1]
        self.counters["merges"] += 1
        return replace(last, state_id=new_state_id(), lineage=Lineage("merge", tuple(r.state_id for r in refs)))

    def evict(self, ref: KVStateRef, owners: Sequence[Hashable]) -> int:
        """Release ``owners``' holds and drop ``ref``'s now-unreferenced blocks; returns bytes freed."""
        for owner in owners:
            self.store.release(owner)
        freed = self.store.discard(ref.blocks)
        self.counters["evicted_bytes"] += freed
        worker_event(
            self.worker,
            STORE_TOPIC,
            {"kind": "evict", "state": ref.state_id, "blocks": len(ref.blocks), "freed_bytes": freed},
        )
        return freed

    def stats(self) -> dict:
        # Tokens whose KV came from a state (or the prefix cache) instead of a prefill.
        avoided = {"prefill_tokens_avoided": self.counters["reused_tokens"]}
        return {"model": self.backend.name, **self.store.stats(), **dict(self.counters), **avoided}


def _same_storage(a, b) -> bool:
    """Whether tensors ``a`` and ``b`` share memory (one is a view of the other's storage)."""
    if a is None or b is None:
        return False
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError):
        return False
