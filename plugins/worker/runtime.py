"""The worker-side operators: what every ``kvs.*`` task ends up calling.

One :class:`StateRuntime` per model lives in each worker's ``kvstate`` plugin; the
tasks in :mod:`dask_kvstate.tasks` call its methods. It is a
:class:`~dask_kvstate.plugins.worker.engine.KVEngine` (hash, prefill, store) with the
operators on top; resolving a consumer's ref is :mod:`~dask_kvstate.plugins.worker.resolve`,
the pull-or-recompute choice inside it :mod:`~dask_kvstate.plugins.worker.placement`,
measurements for benchmarks :mod:`~dask_kvstate.plugins.worker.probes`.

Every operator keeps the library's promise: the KV it builds or reads is the KV of
tokenize(text), so output equals text replay.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from dask_kvstate.blocks import BlockKV, kv_tokens, same_storage
from dask_kvstate.errors import MergeError
from dask_kvstate.generation import Generation, Sampling
from dask_kvstate.plugins.worker import placement, prefix_cache, probes
from dask_kvstate.plugins.worker.accounting import runtime_stats
from dask_kvstate.plugins.worker.engine import KVEngine
from dask_kvstate.plugins.worker.events import worker_event
from dask_kvstate.plugins.worker.resolve import Resolver
from dask_kvstate.protocol import STORE_TOPIC
from dask_kvstate.state import KVState, KVStateRef, Lineage, Placement, incompatibility, new_state_id

if TYPE_CHECKING:
    from dask_kvstate.backends.base import Backend


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (token ids, or texts).

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


class StateRuntime(KVEngine):
    """Operators on one worker: a backend, a block store and the worker's comm pool."""

    def __init__(self, backend: Backend, store, worker=None, counters=None, settings=None):
        super().__init__(backend, store, worker, counters=counters, settings=settings)
        self.resolver = Resolver(self)

    # -- resolving and measuring ---------------------------------------------------
    def resolve(self, ref: KVStateRef, joined: bool = True) -> KVState:
        """``ref`` with its token ids and KV on this worker (see :meth:`Resolver.resolve`)."""
        return self.resolver.resolve(ref, joined)

    def estimate(self, ref: KVStateRef) -> dict:
        """What the transfer-or-recompute rule would do for ``ref`` here now, without doing it."""
        d = placement.estimate(self, ref)
        return {"action": "local", "t_transfer": 0.0, "t_recompute": 0.0} if d is None else d.wire()

    def measure_fill(self, ref: KVStateRef, action: str) -> float:
        """Seconds to pull or recompute all of ``ref``'s blocks here (benchmarks of the rule)."""
        return probes.measure_fill(self.resolver, ref, action)

    def measure_rule(self, ref: KVStateRef, forget: bool = False) -> dict:
        """Fill ``ref``'s blocks here by the rule's own choice, timed (benchmarks of the rule)."""
        return probes.measure_rule(self.resolver, ref, forget)

    def probe(self, sizes=(32, 256)) -> None:
        """Time a few prefills of this worker's model to seed the prefill cost model."""
        probes.probe(self, sizes)

    # -- operators -----------------------------------------------------------------
    def materialize(self, text: str, namespace: str) -> KVStateRef:
        """Prefill ``text`` into blocks, reusing what this worker stores of it (:meth:`stored_past`)."""
        ids = self.backend.tokenize(text)
        if not ids:
            raise ValueError("cannot materialize an empty prompt: the segments joined to no tokens")
        hashes = self.hashes(ids, namespace)
        self.store.pin(self.task_owner(), hashes)
        whole, past = self.stored_past(ids, hashes, namespace)
        if whole < len(hashes):
            self.prefill_and_store(ids, self.as_past(past), hashes, whole, namespace=namespace)
        else:
            self.counters["reused_tokens"] += len(ids)
        self.counters["materializations"] += 1
        return self.new_ref("materialize", (), text, ids, hashes, namespace)

    def extend(self, ref: KVStateRef, text: str) -> KVStateRef:
        """``ref`` followed by ``text``: the KV of tokenize(ref.text + text)."""
        full = ref.text + text
        # A backend with its own paged cache is handed the blocks as they are (see BlockKV):
        # joining them would copy the whole state into fresh memory for a few new tokens.
        old = self.resolve(ref, joined=not self.backend.reads_blocks)
        ids = self.backend.tokenize(full)
        if not ids:
            raise ValueError("cannot extend to an empty prompt")
        hashes = self.hashes(ids, ref.namespace)
        self.store.pin(self.task_owner(), ref.blocks + hashes)
        past = old.kv
        keep = common_prefix(old.token_ids, ids) if past is not None else 0
        if past is not None and keep == len(ids):
            head = _prefix(past, keep)
            # blocks or a tensor: store_kv lays either out
            self.store_kv(head, hashes, keep // self.block_tokens, ids=ids, namespace=ref.namespace)
            self.counters["reused_tokens"] += keep
        else:
            past = _prefix(past, keep) if past is not None and keep else None
            self.prefill_and_store(ids, past, hashes, keep // self.block_tokens, namespace=ref.namespace)
        self.counters["extensions"] += 1
        return self.new_ref("extend", (ref.state_id,), full, ids, hashes, ref.namespace)

    def generate(self, text: str, sampling: Sampling, namespace: str | None = None) -> Generation:
        """Text replay: the whole prompt through the model, no state involved (``namespace``:
        the calling tenant, whose own blocks alone an engine's prefix cache may serve)."""
        t0 = time.perf_counter()
        return self.generate_from(self.backend.tokenize(text), None, sampling, t0, namespace=namespace)

    def generate_cached(self, text: str, namespace: str, sampling: Sampling) -> Generation:
        """Text replay through this worker's automatic prefix cache (:mod:`.prefix_cache`)."""
        return prefix_cache.generate(self, text, namespace, sampling)

    def generate_from(
        self,
        ids: list[int],
        past: torch.Tensor | BlockKV | None,
        sampling: Sampling,
        started: float,
        *,
        namespace: str | None = None,
        borrow: bool = False,
        **hooks,
    ) -> Generation:
        """Decode from ``ids`` with ``past`` as the KV of their leading tokens; counts and measures.

        ``started`` is when the call began, for its time to first token; ``hooks`` go to
        the backend's ``generate`` (``on_prefill``, ``keep_from``). ``borrow``: a long
        prompt, reused or not, runs with the host's idle threads too, as a long prefill does
        (the prefix cache's calls; text replay, a baseline, never borrows).
        """
        keep = 0 if past is None else kv_tokens(past)
        self.counters["reused_tokens"] += keep
        held = self.live.hold((len(ids) + sampling.max_new_tokens) * self.backend.kv_bytes_per_token)
        # The prompt, reused or computed, and the steps decoding over it: what the call reads
        # and runs. Not borrowing: no tokens, so the worker's own count and no round trip.
        with held, self._borrowed_threads(len(ids) + sampling.max_new_tokens if borrow else 0) as threads:
            res = self.backend.generate(ids, past, sampling, started=started, namespace=namespace, **hooks)
        # What the backend computed: fewer than len(ids) - keep where an engine's own prefix
        # cache served some (vLLM), the same on the transformers backend.
        self.counters["prefill_tokens"] += res.prefill_tokens
        self.counters["generations"] += 1
        self._meter_prefill(threads, res.prefill_tokens, res.reused_tokens, res.prefill_s)
        return Generation.from_result(self.backend, res, ids)

    def resume(self, ref: KVStateRef, text: str, sampling: Sampling) -> Generation:
        """Generate from ``ref`` followed by ``text``; equals ``generate(ref.text + text)``.

        The state's KV is read in place (shared-prefix
        attention, ``backends/cascade.py``), not copied into a transformers cache.
        """
        return self._resume_rows(ref, [text], sampling)[0]

    def resume_many(self, ref: KVStateRef, texts: Sequence[str], sampling: Sampling) -> list[Generation]:
        """Sibling resumes from one state, decoded as one batch; one ``Generation`` per text.

        Each equals ``resume(ref, text)``: the state is resolved once, every sibling's
        suffix is prefilled by one forward and the decode steps run batched, all rows
        reading the state's KV in place (``backends/batch.py``).
        """
        self.counters["batched_resumes"] += len(texts)
        self.counters["resume_batches"] += 1
        return self._resume_rows(ref, texts, sampling)

    def _resume_rows(self, ref: KVStateRef, texts: Sequence[str], sampling: Sampling) -> list[Generation]:
        from dask_kvstate.backends.batch import Row, kv_bytes

        t0 = time.perf_counter()
        # A backend with its own paged cache copies the blocks into it: joining them first
        # would be one more copy of the state, into fresh memory (see BlockKV).
        old = self.resolve(ref, joined=not self.backend.reads_blocks)
        rows = []
        for text in texts:
            ids = self.backend.tokenize(ref.text + text)
            # At least the last prompt token is re-run: its logits start decoding.
            keep = min(common_prefix(old.token_ids, ids), len(ids) - 1) if old.usable else 0
            rows.append(Row(ids, keep))
            self.counters["reused_tokens"] += keep
        self.counters["resumes"] += len(rows)
        prefix = old.kv if old.usable and any(r.keep for r in rows) else None
        # Held while decoding: the rows' own buffers, plus the state's KV if it is not the
        # store's own memory (blocks on a lower tier, or not adopted).
        live = kv_bytes(self.backend, rows, sampling.max_new_tokens)
        held = self.store.peek(ref.blocks[0]) if prefix is not None else None
        first = prefix.blocks[0] if isinstance(prefix, BlockKV) else prefix
        if prefix is not None and not same_storage(first, held):
            live += prefix.nbytes
        # A batch of siblings decoding on their state's holder is the workflow's critical path
        # as much as the state's prefill, with the workers that wait on it idle beside it: a
        # resume (one row or a batch) borrows their threads as a long prefill does, when the
        # tokens it runs through the model and the state's it reads reach the same threshold.
        shared = max(r.keep for r in rows) if prefix is not None else 0  # read once for all rows
        work = shared + sum(len(r.ids) - r.keep for r in rows) + len(rows) * sampling.max_new_tokens
        with self.live.hold(live), self._borrowed_threads(work) as threads:
            results = self.backend.generate_batch(rows, prefix, sampling, started=t0, namespace=ref.namespace)
        self.counters["generations"] += len(rows)
        out = []
        batch_id = new_state_id()  # rows of one batch share its decode time (decode_s is the batch's)
        for row, res in zip(rows, results):
            self.counters["prefill_tokens"] += res.prefill_tokens  # what the backend computed (see generate_from)
            self._meter_prefill(threads, res.prefill_tokens, res.reused_tokens, res.prefill_s)
            g = Generation.from_result(self.backend, res, row.ids)
            g.batch_id, g.batch_rows = batch_id, len(rows)
            out.append(g)
        return out

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
        # Batched resumes the fused path could not serve (run per row with the model's own attention), by reason.
        fallbacks = dict(self.backend.cascade_fallbacks)
        return {
            **runtime_stats(self.backend.name, self.store, self.counters),
            "cascade_fallbacks": fallbacks,
            "engine": self.backend.engine_stats(),
        }


def _prefix(kv: torch.Tensor | BlockKV, tokens: int) -> torch.Tensor | BlockKV:
    """The KV of the first ``tokens`` tokens of ``kv``, in its own form (views, no copy)."""
    return kv.head(tokens) if isinstance(kv, BlockKV) else kv[:, :, :, :tokens]
