"""The agent components of the Nalar workflows: each sleeps for its drawn duration, none computes.

Sleeping lets one process hold many single-thread workers, one unit of one role each,
while Dask and the policies still see real task durations, results and sizes.
"""

from __future__ import annotations

import time

import dask
from dask.sizeof import sizeof
from distributed import get_worker

import dask_kvstate as kvs


def work(seconds: float, *deps) -> float:
    """A component call of ``seconds``; ``deps`` are its inputs (futures), only waited for."""
    time.sleep(seconds)
    return seconds


class LaneContext:
    """What a developer attempt leaves behind: where its context (KV) lives, and how big it is.

    Like ``KVStateRef``, its ``dask.sizeof`` is the KV bytes behind it, not the few bytes
    it pickles to: so Dask (``decide_worker``, its WorkStealing) and our stealing's
    ``C_mig`` price moving the next attempt away at the time a rebuild costs.
    """

    def __init__(self, worker: str, kv_bytes: int):
        self.worker, self.kv_bytes = worker, kv_bytes


@sizeof.register(LaneContext)
def _sizeof_lane_context(ctx: LaneContext) -> int:
    return ctx.kv_bytes


def develop(seconds: float, rebuild: float, previous: LaneContext | None, *deps) -> LaneContext:
    """A developer attempt; away from the lane's previous worker it first rebuilds its context."""
    me = get_worker().address
    time.sleep(seconds + (rebuild if previous is not None and previous.worker != me else 0.0))
    # The rebuild time at Dask's bandwidth estimate: what moving this context costs.
    return LaneContext(me, int(rebuild * dask.utils.parse_bytes(dask.config.get("distributed.scheduler.bandwidth"))))


def run_tests(seconds: float, passes: bool, *deps) -> bool:
    """A tester call: takes ``seconds``, returns the drawn outcome."""
    time.sleep(seconds)
    return passes


BATCH_EXTRA = 0.25  # each extra row of a batched call costs this fraction of its own time


def _classify_many(calls: list[tuple]) -> list[float]:
    """The router's classifier, batched: one call for many requests (``kvs.batchable``'s contract).

    Batched LLM decoding is bound by reading the weights, so a batch costs about its
    longest row plus a little per extra row (SmolLM2 on CPU: 0.12 s a step at batch 1,
    0.6 s at batch 16, i.e. ~0.25x per extra row); without the hint every call is a
    batch of one and costs exactly its own time.
    """
    ds = [c[0] for c in calls]
    time.sleep(max(ds) + BATCH_EXTRA * (sum(ds) - max(ds)))
    return ds


classify = kvs.batchable(_classify_many)
