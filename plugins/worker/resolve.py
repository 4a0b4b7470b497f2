"""Resolving a ref: turning a state's metadata into its KV tensors on this worker.

The paper's rule: local blocks are hits; missing blocks are pulled from the holder
(or recomputed, as :mod:`~dask_kvstate.plugins.worker.placement` chooses); whatever is
still missing (holder gone, holder evicted them, pull failed) is recomputed from the
state's text. An incompatible state (other model, config or tokenizer) is never used:
its text is prefilled from scratch by the operator. No path raises because KV went
missing, and every path yields the KV of tokenize(text), so output equals text replay.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dask_kvstate.blocks import BlockKV, join_blocks, same_storage
from dask_kvstate.blocks import nbytes as tensor_bytes
from dask_kvstate.placement import Decision
from dask_kvstate.plugins.worker import placement
from dask_kvstate.plugins.worker.checksum import ChecksumError
from dask_kvstate.plugins.worker.engine import KVEngine
from dask_kvstate.plugins.worker.events import worker_event
from dask_kvstate.plugins.worker.pull_plan import pull_missing
from dask_kvstate.plugins.worker.transport import PullResult, pull_beside, pull_blocks, pull_within, wait_pull
from dask_kvstate.protocol import COMPATIBILITY_TOPIC
from dask_kvstate.state import KVState, KVStateRef, incompatibility

logger = logging.getLogger("dask_kvstate")


class Resolver:
    """Resolves refs for one engine, one resolve of a block table at a time."""

    def __init__(self, kv: KVEngine):
        self.kv = kv
        self._guard = threading.Lock()
        self._locks: dict[tuple[bytes, ...], tuple[threading.Lock, int]] = {}

    def resolve(self, ref: KVStateRef, joined: bool = True) -> KVState:
        """``ref`` with its token ids and KV on this worker (``kv`` None if unusable here).

        ``kv`` is one joined tensor, or with ``joined=False`` the blocks themselves as a
        :class:`~dask_kvstate.blocks.BlockKV` (for a backend that copies them into its
        own paged cache anyway). Never raises for missing blocks, dead holders or
        incompatible states.
        """
        kv = self.kv
        if not isinstance(ref, KVStateRef):
            raise TypeError(
                f"expected a KVStateRef (the result of kvs.materialize/extend/fork), got {type(ref).__name__}"
            )
        ids = kv.backend.tokenize(ref.text)
        why = incompatibility(ref, model=kv.backend.model_fingerprint, config=kv.backend.config_fingerprint)
        if why is None and (len(ids) != ref.num_tokens or kv.hashes(ids, ref.namespace) != ref.blocks):
            why = "its block table does not match the tokens of its text"
        if why is not None:
            kv.counters["incompatible"] += 1
            logger.info("kvstate: not reusing state %s (%s); recomputing from text", ref.state_id[:8], why)
            # One event per refusal: rare by nature, and each names a state a user may be debugging.
            worker_event(
                kv.worker,
                COMPATIBILITY_TOPIC,
                {
                    "kind": "refused",
                    "state": ref.state_id,
                    "model": ref.model_name,
                    "here": kv.backend.name,
                    "tokens": ref.num_tokens,
                    "reason": why,
                },
            )
            return KVState(ref, ids, None)
        if not ids:
            return KVState(ref, ids, None)
        kv.store.pin(kv.task_owner(), ref.blocks)
        # One resolve of a block table at a time on this worker: concurrent resumes of one
        # state (sibling batches on a worker with several threads) would each pull or
        # recompute the missing blocks and each keep a joined copy; the later ones find
        # the first's blocks, adopted, and join them to a view.
        with self._resolving(ref.blocks):
            return KVState(ref, ids, self.fill(ref, ids, joined))

    @contextlib.contextmanager
    def _resolving(self, blocks: tuple[bytes, ...]):
        with self._guard:
            lock, users = self._locks.get(blocks, (None, 0))
            lock = lock or threading.Lock()
            self._locks[blocks] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[blocks]
                if users == 1:
                    del self._locks[blocks]
                else:
                    self._locks[blocks] = (lock, users - 1)

    def fill(self, ref: KVStateRef, ids: list[int], joined: bool = True) -> torch.Tensor | BlockKV:
        """The KV of ``ref``'s blocks on this worker as one tensor (or its blocks, unless
        ``joined``): held, pulled or recomputed."""
        return self.fill_decided(ref, ids, joined)[0]

    def fill_decided(
        self, ref: KVStateRef, ids: list[int], joined: bool = True
    ) -> tuple[torch.Tensor | BlockKV, Decision | None]:
        """:meth:`fill`, and the transfer-or-recompute decision it carried out with its
        ``seconds`` (None when nothing was missing or no peer held it; benchmarks read it)."""
        kv = self.kv
        tensors = [kv.store.get(h) for h in ref.blocks]
        missing = [h for h, t in zip(ref.blocks, tensors) if t is None]
        kv.counters["block_hits"] += len(tensors) - len(missing)
        holder = ref.placement.worker
        decision = None
        t0 = time.perf_counter()
        if missing and kv.worker is not None and holder not in (None, kv.address):
            first = next(i for i, t in enumerate(tensors) if t is None)
            decision = placement.choose(kv, ref, first, holder)
            decision.decide_s = time.perf_counter() - t0  # the rule (and, for a task never placed, asking for copies)
            t0 = time.perf_counter()
        if decision is not None and decision.action == "pull":
            source = decision.holder or holder
            assert source is not None, "a decision is made only for a state held elsewhere"
            tensors = pull_missing(self, ref, tensors, source, decision)
        first_missing = next((i for i, t in enumerate(tensors) if t is None), None)
        if first_missing is not None:
            tensors = self.recompute(ids, ref.blocks, tensors, first_missing, namespace=ref.namespace)
        if decision is not None:
            # what the choice cost in all: a pull's steps and whatever was recomputed after
            decision.seconds = time.perf_counter() - t0
            placement.record_outcome(kv, decision)
        device = kv.backend.device  # a block read back from a lower tier may sit in host memory
        on_device = [t.to(device, non_blocking=True) for t in tensors]
        if not joined:
            return BlockKV(tuple(on_device)), decision
        whole = join_blocks(on_device)
        if len(tensors) > 1 and not same_storage(whole, tensors[0]):
            # Keep the joined copy as the blocks' storage: one copy of the state here, not two.
            kv.counters["adopted_blocks"] += kv.store.adopt(ref.blocks, whole, kv.block_tokens)
        assert whole is not None, "a compatible state with tokens has blocks"
        return whole, decision

    def block_shapes(self, ref: KVStateRef) -> dict[bytes, tuple[int, ...]]:
        """``hash -> shape`` each of ``ref``'s blocks has for this worker's model (the last one may be shorter)."""
        b, bt = self.kv.backend, ref.block_tokens
        return {
            h: (b.num_layers, 2, b.kv_heads, min(bt, ref.num_tokens - i * bt), b.head_dim)
            for i, h in enumerate(ref.blocks)
        }

    def _options(self) -> dict:
        kv = self.kv
        return {
            "connect_timeout": kv.settings.connect_timeout,
            "timeout": kv.settings.pull_timeout,
            "emulated_bandwidth": kv.settings.emulated_bandwidth,
        }

    def pull(
        self, holder: str, hashes: list[bytes], shapes: Mapping[bytes, tuple[int, ...]], patience: float | None = None
    ) -> dict[bytes, Any]:
        """Blocks ``hashes`` from worker ``holder``, stored here; ``{}`` when the pull fails (logged).

        With ``patience`` (seconds) a pull still running by then is cut off (``{}``,
        ``pulls_cut_off``); it finishes in the background, where only its time is kept.

        A reply whose frames fail their checksum fails as a whole (``pull_checksum_failures``).
        Of a reply read, only blocks asked for, of the shape ``shapes`` gives and the
        model's dtype, are stored; any other block is dropped (``rejected_blocks``), so
        the caller recomputes it like a missing one and no later task finds it here.
        """
        from distributed.utils import sync

        kv = self.kv
        try:
            res: PullResult | None
            if patience is None:
                res = sync(kv.worker.loop, pull_blocks, kv.worker.rpc, holder, hashes, **self._options())
            else:
                late = functools.partial(timed_late, kv, holder)
                res = sync(
                    kv.worker.loop, pull_within, patience, late, kv.worker.rpc, holder, hashes, **self._options()
                )
            return self._receive(holder, res, hashes, shapes)
        except Exception as e:
            return self._failed(holder, hashes, e)

    def pull_beside(
        self, holder: str, hashes: list[bytes], ahead: list[bytes], shapes: Mapping, patience: float
    ) -> tuple[dict[bytes, Any], Ahead | None]:
        """:meth:`pull` of ``hashes`` with ``patience``, and a pull of ``ahead`` asked for
        at once beside it; the second as an :class:`Ahead` for :meth:`take` or
        :meth:`drop` (None when the first came to nothing: then it is cancelled).

        A first reply that fails its checksum or is malformed fails like :meth:`pull`
        (``{}``, counted); the pull beside it is cancelled, its holder being suspect."""
        from distributed.utils import sync

        kv = self.kv
        late = functools.partial(timed_late, kv, holder)
        try:
            res, task = sync(
                kv.worker.loop, pull_beside, patience, late, kv.worker.rpc, holder, hashes, ahead, **self._options()
            )
        except Exception as e:
            return self._failed(holder, hashes, e), None
        try:
            got = self._receive(holder, res, hashes, shapes)
        except Exception as e:
            kv.worker.loop.add_callback(task.cancel)
            return self._failed(holder, hashes, e), None
        if not got:
            kv.worker.loop.add_callback(task.cancel)
            return got, None
        return got, Ahead(task, ahead, sum(tensor_bytes(t) for t in got.values()))

    def take(self, holder: str, ahead: Ahead, shapes: Mapping, patience: float) -> dict[bytes, Any]:
        """The blocks of a pull asked for beside another (:meth:`pull_beside`), waited for
        ``patience`` more seconds at most, stored; ``{}`` when it failed or was cut off.
        Timed with the pull beside it: both bytes, in its time from the start of both."""
        from distributed.utils import sync

        try:
            res = sync(self.kv.worker.loop, wait_pull, ahead.task, patience)
            return self._receive(holder, res, ahead.hashes, shapes, beside_bytes=ahead.beside_bytes)
        except Exception as e:
            return self._failed(holder, ahead.hashes, e)

    def drop(self, ahead: Ahead) -> None:
        """Cancel a pull asked for beside another (its comm is aborted: the link is free at once)."""
        self.kv.worker.loop.add_callback(ahead.task.cancel)

    def _failed(self, holder: str, hashes: list[bytes], e: Exception) -> dict:
        kv = self.kv
        kv.counters["transfer_failures"] += 1
        if isinstance(e, ChecksumError):
            kv.counters["pull_checksum_failures"] += 1
        logger.warning(
            "kvstate: pulling %d blocks from %s failed (%s: %s); recomputing", len(hashes), holder, type(e).__name__, e
        )
        return {}

    def _receive(
        self, holder: str, res: PullResult | None, hashes: list[bytes], shapes: Mapping, beside_bytes: int = 0
    ) -> dict[bytes, Any]:
        """The accepted blocks of a reply, stored and counted, and its time metered (``{}`` when cut off)."""
        kv = self.kv
        if res is None:
            kv.counters["pulls_cut_off"] += 1
            return {}
        got = res.blocks()  # in this thread: checking the checksums reads every byte
        blocks, rejected = accepted(got, {h: shapes[h] for h in hashes}, kv.backend.dtype)
        if rejected:
            kv.counters["rejected_blocks"] += len(rejected)
            logger.warning(
                "kvstate: %s sent %d blocks not asked for or of the wrong shape or dtype; recomputing them",
                holder,
                len(rejected),
            )
        for h, t in blocks.items():  # the store moves them to its device; resolve to the model's
            kv.store.put(h, t)
        nbytes = sum(tensor_bytes(t) for t in blocks.values())
        kv.counters["transfers"] += len(blocks)
        kv.counters["pulls_zero_copy" if res.zero_copy else "pulls_packed"] += 1
        kv.counters["transfer_bytes"] += nbytes
        kv.counters["transfer_seconds"] += res.seconds  # type: ignore[assignment]  # a float counter
        kv.links.add(holder, nbytes + beside_bytes, res.seconds)
        return blocks

    def recompute(self, ids, hashes, tensors, first: int, *, namespace: str | None = None) -> list[torch.Tensor]:
        """``tensors`` with blocks ``first...`` rebuilt by a prefill (as a request of the
        state's ``namespace``) over the ones before, and stored."""
        kv = self.kv
        past = join_blocks(tensors[:first])
        rebuilt = kv.prefill_and_store(ids, past, hashes, first, namespace=namespace)
        kv.counters["recomputes"] += len(hashes) - first
        kv.counters["recompute_tokens"] += len(ids) - first * kv.block_tokens
        return tensors[:first] + rebuilt


@dataclass
class Ahead:
    """A pull asked for beside another (:meth:`Resolver.pull_beside`), still on its way."""

    task: Any  # the asyncio task of its reply, on the worker's event loop
    hashes: list[bytes]
    beside_bytes: int  # bytes the pull beside it brought over the same link meanwhile


def accepted(blocks: dict, shapes: Mapping[bytes, tuple[int, ...]], dtype) -> tuple[dict, list[bytes]]:
    """The pulled blocks that may be stored, and the hashes of the others.

    A block is kept when its hash was asked for (a key of ``shapes``) and it has that
    shape and ``dtype``; a holder's reply is never trusted further than that.

    >>> import torch
    >>> ok, bad = accepted({b"a": torch.zeros(1, 2, 1, 4, 2), b"b": torch.zeros(1, 2, 1, 3, 2), b"c": torch.zeros(1)},
    ...                    {b"a": (1, 2, 1, 4, 2), b"b": (1, 2, 1, 4, 2)}, torch.float32)
    >>> list(ok), bad
    ([b'a'], [b'b', b'c'])
    """
    keep, rejected = {}, []
    for h, t in blocks.items():
        if shapes.get(h) == tuple(t.shape) and t.dtype == dtype:
            keep[h] = t
        else:
            rejected.append(h)
    return keep, rejected


def timed_late(kv: KVEngine, holder: str, task) -> None:
    """Time a pull that was cut off once it finishes (its blocks are not used): the link's real rate."""
    if task.cancelled() or task.exception() is not None:
        return
    res = task.result()
    kv.counters["late_pulls_timed"] += 1
    kv.links.add(holder, res.nbytes, res.seconds)
