"""Benchmark probes: task functions that measure the transfer-versus-recompute rule on a worker.

Not operators: they build no state a workflow uses, they time or explain what the
runtime would do. Submit them like :mod:`dask_kvstate.tasks` functions, pinned to the
worker to measure and never deduplicated (each call is a new measurement)::

    from dask_kvstate.bench import probes

    seconds = client.submit(probes.measure_fill, ref, "pull", workers=[b], pure=False).result()

Each finds its worker's ``kvstate`` runtime the way the operators do
(:func:`dask_kvstate.tasks.runtime_for_state`); the timing itself is the runtime's
(``plugins/worker/probes.py``), so the benchmarks measure the code paths tasks take.
"""

from __future__ import annotations

import time
from typing import Any

from distributed import get_worker
from distributed.utils import sync

from dask_kvstate.state import KVStateRef
from dask_kvstate.tasks import runtime_for_state


def estimate(state: KVStateRef) -> dict:
    """The transfer-versus-recompute rule's view of ``state`` on this worker (nothing moves)."""
    return runtime_for_state(state).estimate(state)


def measure_fill(state: KVStateRef, action: str) -> float:
    """Seconds to fill all of ``state``'s blocks on this worker by ``action`` (``"pull"`` or
    ``"recompute"``), whatever the rule would choose: both sides of the crossover. Starts
    from none of them held here and drops them again after."""
    return runtime_for_state(state).measure_fill(state, action)


def measure_rule(state: KVStateRef, forget: bool = False) -> dict:
    """The rule's own fill of ``state``'s blocks on this worker, timed: its decision and ``seconds``.

    ``forget`` drops what this worker measured of the holder's link first, so the fill
    runs as a first contact does (with its probe and cut-off).
    """
    return runtime_for_state(state).measure_rule(state, forget)


def measure_raw_fetch(key: str, holder: str) -> float:
    """Seconds for this worker to fetch task result ``key`` from ``holder`` the way Dask
    moves any data (``get_data``): the baseline KV pulls are measured against.

    Raises RuntimeError naming ``key`` and ``holder`` when the holder does not return it.
    """
    from distributed.worker import get_data_from_worker

    worker = get_worker()
    t0 = time.perf_counter()
    resp: Any = sync(worker.loop, get_data_from_worker, worker.rpc, [key], holder, who=worker.address)
    seconds = time.perf_counter() - t0
    if key not in resp.get("data", {}):
        raise RuntimeError(f"{holder} did not return {key!r}: {resp.get('status')}")
    return seconds
