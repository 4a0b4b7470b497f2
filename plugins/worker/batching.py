"""The ``kvstate-batching`` worker plugin: ready tasks of a batchable component run as one call.

Nalar coalesces the queued requests of an agent that supports batching. On a Dask
worker those requests are the component's tasks waiting in the worker's ready heaps
(``WorkerState.ready`` / ``.constrained``). Why this design:

* **The first task to start leads the batch.** Its thread (the one slot the worker's
  state machine gave it) takes the other ready tasks of the component, up to
  ``max-batch``, reads their arguments and calls the batch function once. No thread
  waits for a batch to fill, and a component that is not busy runs at once (a batch of
  one; ``kvstate.scheduling.batch-window`` > 0 makes the leader wait that long for
  company, which pays only when arrivals are closer than a call).
* **Every task keeps its own life in Dask.** The followers stay in the ready heap and
  are moved to its front; when their turn comes (next, on a one-thread worker) the
  wrapped call finds its result and returns it (or raises its own error) at once. So
  each task still goes ``ready -> executing -> memory`` through Dask's state machine,
  with its own key, result, error, retries and dependents; nothing here fakes a
  transition. A follower stolen or released before its turn is just computed again
  where it lands (its stored result is dropped).
* Arguments are read by evaluating the follower's own ``run_spec`` with the worker's
  data while :class:`~dask_kvstate.hints.BatchedCall` only records them, so
  dependencies and nested containers resolve exactly as in a real call.
* If the batch call raises, every element is run alone, so the error reaches only the
  tasks whose own arguments raise.

The scheduler extension ``kvstate-hints`` registers this plugin on every worker when a
component is hinted ``batchable`` and sends such tasks to workers instead of its
root-ish queue, so they can meet here.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections import Counter
from time import monotonic

from distributed import WorkerPlugin

from dask_kvstate.hints import BatchedCall, capture_args
from dask_kvstate.protocol import BATCHING_WORKER_PLUGIN
from dask_kvstate.session import component_of

logger = logging.getLogger("dask_kvstate")

_HEAPED = ("ready", "constrained")
#: Task states in which a leader's thread may still be running its batch.
_LEADING = ("executing", "long-running", "cancelled", "resumed")
#: Seconds between a waiting follower's checks that its leader still runs.
_LEADER_CHECK_S = 1.0


class _Slot:
    """A follower's result, filled by its batch's leader (the task ``leader``)."""

    __slots__ = ("done", "leader", "outcome")

    def __init__(self, leader):
        self.done = threading.Event()
        self.leader = leader
        self.outcome: tuple[bool, object] | None = None  # (ok, value or exception); None: run alone


def _one(call: BatchedCall, args: tuple) -> tuple[bool, object]:
    try:
        return True, call.run([args])[0]
    except Exception as e:
        return False, e


def _unwrap(outcome: tuple[bool, object]):
    ok, value = outcome
    if ok:
        return value
    assert isinstance(value, BaseException), "a failed outcome carries its exception"
    raise value


class BatchingWorkerPlugin(WorkerPlugin):
    """Coalesces ready tasks of batchable components on this worker (see the module doc)."""

    name = BATCHING_WORKER_PLUGIN
    idempotent = False  # new hints replace the old plugin

    def __init__(self, batch: dict, window: float):
        if not isinstance(batch, dict) or not all(v is None or (isinstance(v, int) and v >= 1) for v in batch.values()):
            raise ValueError(f"batch caps must be {{component: positive int or None}}, got {batch!r}")
        if not window >= 0:
            raise ValueError(f"batch window must be >= 0 seconds, got {window!r}")
        self.batch = dict(batch)
        self.window = float(window)

    def setup(self, worker) -> None:
        self.worker = worker
        self.lock = threading.Lock()
        self.claims: dict = {}  # follower key -> _Slot
        self.sizes: Counter[int] = Counter()  # batch size -> batches
        self.counters: Counter[str] = Counter()

    # -- in the task's thread ------------------------------------------------------------
    def run(self, call: BatchedCall, key, args: tuple):
        with self.lock:
            slot = self.claims.pop(key, None)
        if slot is not None:  # a follower: a leader ran it (on a one-thread worker: already done)
            self._wait_for_leader(slot)
            if slot.outcome is not None:
                self.counters["followers"] += 1
                return _unwrap(slot.outcome)
            return _unwrap(_one(call, args))  # its leader could not read its arguments
        ts = self.worker.state.tasks.get(key)
        comp = component_of(ts) if ts is not None else None
        if comp not in self.batch:
            self.sizes[1] += 1
            return _unwrap(_one(call, args))
        from distributed.utils import sync

        peers = sync(self.worker.loop, self._collect, key, call.name, comp, self.batch[comp])
        return self._lead(call, args, peers)

    def _wait_for_leader(self, slot: _Slot) -> None:
        """Until the leader fills ``slot``, or is found no longer running (then this task runs alone).

        Every path of a leader sets ``done``; the check is the guard that a follower's
        thread never waits forever on a leader that is gone.
        """
        while not slot.done.wait(_LEADER_CHECK_S):
            ts = self.worker.state.tasks.get(slot.leader)
            if (ts is None or ts.state not in _LEADING) and not slot.done.is_set():
                logger.warning(
                    "kvstate batching: leader %s ended without this task's result; it runs alone", slot.leader
                )
                self.counters["orphaned_followers"] += 1
                return

    def _lead(self, call: BatchedCall, args: tuple, peers: list):
        calls, taken = [args], []
        try:
            for key, run_spec, data, slot in peers:
                try:
                    calls.append(capture_args(run_spec, data))
                    taken.append((key, slot))
                except Exception:
                    logger.warning(
                        "kvstate batching: could not read the arguments of %s; it runs alone", key, exc_info=True
                    )
                    slot.done.set()
            try:
                outcomes = [(True, r) for r in call.run(calls)]
            except Exception:
                # Which element failed is unknown: run each alone, so only its own task fails.
                self.counters["split_batches"] += 1
                outcomes = [_one(call, c) for c in calls]
            for (_, slot), outcome in zip(taken, outcomes[1:]):
                slot.outcome = outcome
            self.sizes[len(calls)] += 1
            return _unwrap(outcomes[0])
        finally:
            for _, slot in taken:
                slot.done.set()
            if taken:
                self.worker.loop.add_callback(self._expedite, [k for k, _ in taken])

    # -- on the worker's event loop --------------------------------------------------------
    def _peers(self, key, name: str, comp: str, cap: int | None) -> list:
        st = self.worker.state
        found = []
        for heap in (st.ready, st.constrained):
            for ts in heap:
                func = getattr(ts.run_spec, "func", None)
                if (
                    ts.key != key
                    and isinstance(func, BatchedCall)
                    and func.name == name
                    and ts.key not in self.claims
                    and component_of(ts) == comp
                ):
                    found.append(ts)
        found.sort(key=lambda ts: ts.priority)
        return found if cap is None else found[: cap - 1]

    async def _collect(self, key, name: str, comp: str, cap: int | None) -> list:
        """Claim up to ``cap - 1`` ready peers of the leader ``key``; their specs and input data."""
        self._drop_stale_claims()
        deadline = monotonic() + self.window
        while True:
            peers = self._peers(key, name, comp, cap)
            left = deadline - monotonic()
            if left <= 0 or (cap is not None and len(peers) >= cap - 1):
                break
            await asyncio.sleep(min(left, 0.001))
        out = []
        for ts in peers:
            try:
                data = {d.key: self.worker.data[d.key] for d in ts.dependencies}
            except KeyError:
                continue  # an input left meanwhile: Dask will fetch it again, this task runs on its own
            except Exception:  # an input that cannot be read back (a failed unspill): not this batch's
                logger.warning(
                    "kvstate batching: could not read the inputs of %s; it runs alone", ts.key, exc_info=True
                )
                continue
            slot = _Slot(key)
            with self.lock:
                self.claims[ts.key] = slot
            out.append((ts.key, ts.run_spec, data, slot))
        return out

    def _expedite(self, keys: list) -> None:
        """Move finished followers to the front of their ready heap: their results are waiting."""
        st = self.worker.state
        for key in keys:
            ts = st.tasks.get(key)
            if ts is None or ts.state not in _HEAPED:
                continue
            heap = st.ready if ts.state == "ready" else st.constrained
            heap.discard(ts)  # a HeapSet keeps the key it was added with: remove, re-key, add
            ts.priority = (-math.inf, *ts.priority)
            heap.add(ts)

    def _drop_stale_claims(self) -> None:
        st = self.worker.state
        with self.lock:
            for key in [
                k
                for k, slot in self.claims.items()
                if slot.done.is_set() and getattr(st.tasks.get(k), "state", None) not in (*_HEAPED, "executing")
            ]:
                del self.claims[key]
                self.counters["dropped_claims"] += 1

    def stats(self) -> dict:
        return {
            "sizes": dict(self.sizes),
            "batches": sum(n for s, n in self.sizes.items() if s > 1),
            "batched_tasks": sum(s * n for s, n in self.sizes.items() if s > 1),
            "claims": len(self.claims),
            **dict(self.counters),
        }
