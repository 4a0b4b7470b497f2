"""The global control loop's pass latency with every policy on and many futures queued.

Two phases, each on a fresh cluster: role-restricted tasks queued behind busy role
workers, then root-ish tasks queued on the scheduler itself.
"""

from __future__ import annotations

import asyncio
import json
import os

import dask_kvstate as kvs
from dask_kvstate.bench.nalar.components import work
from dask_kvstate.bench.nalar.runner import CONFIGS, cluster_spec, policy_cluster
from dask_kvstate.bench.nalar.workflows import Workflow, role
from dask_kvstate.protocol import SESSIONS_EXTENSION


def _loop_state(dask_scheduler, reset: bool = False) -> dict:
    loop = dask_scheduler.plugins[SESSIONS_EXTENSION].loop
    if reset:
        for samples in loop.latency.values():
            samples.clear()
    return {
        "tasks": len(dask_scheduler.tasks),
        "queued_on_scheduler": len(dask_scheduler.queued),
        "queued_on_workers": sum(max(len(ws.processing) - ws.nthreads, 0) for ws in dask_scheduler.workers.values()),
        "loop": loop.stats(),
    }


async def control_loop(n_futures: int, seconds: float) -> dict:
    """Every policy on, ``n_futures`` queued: behind busy role workers, then in the scheduler's queue.

    The latency samples are reset once every future is on the scheduler, so they cover
    the steady state with the full queue (tasks sleep 0.5 s: few finish meanwhile).
    """
    wf = Workflow("load", {"planner": 2, "developer": 4, "tester": 2}, rate=1.0)
    settings = {f"kvstate.scheduling.{k}": v for k, v in CONFIGS["all"].items()}
    out: dict = {"futures": n_futures, "seconds": seconds}
    for phase in ("role-restricted, queued on workers", "root-ish, queued on the scheduler"):
        async with policy_cluster(cluster_spec(wf), settings) as c:
            futures, per_session = [], 10
            for sid in range(n_futures // per_session):
                with kvs.session(f"load-{sid}"):
                    r = ("developer", "tester", "planner")[sid % 3]
                    keys = [f"{r if phase.startswith('role') else 'job'}-{sid}-{j}" for j in range(per_session)]
                    res = role(r) if phase.startswith("role") else None
                    futures += c.map(work, [0.5] * per_session, range(per_session), key=keys, resources=res)
            while (await c.run_on_scheduler(_loop_state))["tasks"] < len(futures):
                await asyncio.sleep(0.1)
            await c.run_on_scheduler(_loop_state, reset=True)
            await asyncio.sleep(seconds)
            out[phase] = await c.run_on_scheduler(_loop_state)
            await c.cancel(futures)
    return out


def measure_control_loop(n_futures: int, out: str, seconds: float = 5.0) -> dict:
    """:func:`control_loop`, printed as JSON and written to ``<out>/control_loop.json``."""
    res = asyncio.run(control_loop(n_futures, seconds=seconds))
    print(json.dumps(res, indent=1))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "control_loop.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res
