"""Where a benchmark's KV came from: the store tiers each task read, the lifecycle's prefetches.

Bench instrumentation, not part of the library: the ``kvstate-lifecycle`` row of
:mod:`dask_kvstate.bench.beyond_memory` reports per visit which tiers its task read its
blocks from and how many blocks the lifecycle brought up for it ahead of time.
"""

from __future__ import annotations

import time

from distributed import WorkerPlugin

from dask_kvstate.protocol import WORKER_PLUGIN


class TierReads(WorkerPlugin):
    """The store tiers each visit's task read its blocks from, and when it ran.

    Per task, the store's hit counters at its start and end: exact on a one-thread
    worker, where no other task reads between (a lifecycle prefetch moves blocks
    without counting hits). Bench instrumentation, not part of the library.
    """

    name = "bench-tier-reads"

    def setup(self, worker) -> None:
        self.worker = worker
        self.started: dict = {}
        self.visits: dict = {}

    def _hits(self) -> dict[str, int]:
        tiers = self.worker.plugins[WORKER_PLUGIN].runtime.store.counters
        return {t: tiers[t]["hits"] for t in ("device", "host", "disk")}

    def transition(self, key, start, finish, **kwargs) -> None:
        if not str(key).startswith("kvs-generate"):
            return
        if finish == "executing":
            self.started[key] = (time.time(), time.perf_counter(), self._hits())
        elif start == "executing" and key in self.started:
            at, t0, before = self.started.pop(key)
            after = self._hits()
            self.visits[key] = {
                "at": at,
                "seconds": time.perf_counter() - t0,
                "tiers": {t: after[t] - before[t] for t in after if after[t] > before[t]},
            }


class PredictedPrefetches:
    """The lifecycle's prefetches that a prediction decided (not a task already running),
    from its ``kvstate-lifecycle`` events (``client.get_events``)."""

    def __init__(self, events) -> None:
        msgs = [m for _, m in events]
        predicted = {(m["session"], m["at"]) for m in msgs if m.get("phase") == "decision" and m["why"] == "prediction"}
        self.done = [
            m
            for m in msgs
            if m["kind"] == "prefetch" and m.get("phase") == "done" and (m["session"], m["decision"]) in predicted
        ]

    def blocks(self, session: str, after: float, until: float) -> int:
        """Blocks moved up for ``session`` by predictions decided in ``(after, until]``."""
        return sum(m["blocks"] for m in self.done if m["session"] == session and after < m["decision"] <= until)
