"""One run of a Nalar workflow under one configuration, and the repeats that make a table row.

A run starts an in-process ``SpecCluster`` of single-thread role workers, replays the
seeded open-loop (Poisson) arrivals of :mod:`~dask_kvstate.bench.nalar.workflows`, and
returns the end-to-end latency statistics with what the policies and Dask's stealing
did. Configurations: ``default`` (stock Dask, WorkStealing on, nothing of ours), each
mechanism alone and ``all``; a ``+hints`` suffix adds the workflow's component hints.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import AsyncIterator, Awaitable
from typing import cast

import dask
import numpy as np
from distributed import Client, Scheduler, SpecCluster, Worker

import dask_kvstate as kvs
from dask_kvstate.bench.nalar import report
from dask_kvstate.bench.nalar.workflows import WORKFLOWS, Draws, Workflow, analyst, configure, role, router, swe
from dask_kvstate.protocol import BATCHING_WORKER_PLUGIN

CONFIGS = {
    "default": {},
    "priority": {"priority.enabled": True},
    "stealing": {"stealing.enabled": True},
    "capacity": {"capacity.enabled": True},
    "all": {"priority.enabled": True, "stealing.enabled": True, "capacity.enabled": True},
    # pairs, for ablations (not in the default set)
    "capacity+stealing": {"stealing.enabled": True, "capacity.enabled": True},
    "capacity+priority": {"priority.enabled": True, "capacity.enabled": True},
}
DEFAULT_CONFIGS = "default,priority,stealing,capacity,all"


# The library's scheduling API is called from these two functions only, so a change of it
# is a change here. On an asynchronous client both calls return awaitables.
async def install_policies(c: Client) -> None:
    """Register the scheduling extensions the current ``kvstate.scheduling.*`` config enables."""
    await cast(Awaitable[dict], kvs.install(c, model=False))


@contextlib.asynccontextmanager
async def policy_cluster(workers: dict, settings: dict) -> AsyncIterator[Client]:
    """An in-process ``SpecCluster`` of ``workers`` under ``settings``, the policies installed: its client."""
    with dask.config.set(settings):
        async with (
            SpecCluster(
                workers=workers,
                asynchronous=True,
                scheduler={"cls": Scheduler, "options": {"dashboard_address": None}},
            ) as cluster,
            Client(cluster, asynchronous=True) as c,
        ):
            await install_policies(c)
            yield c


async def policy_stats(c: Client) -> dict:
    """What the scheduling extensions did (``kvs.stats(c).scheduling``)."""
    return (await cast(Awaitable[kvs.Stats], kvs.stats(c))).scheduling


def cluster_spec(wf: Workflow) -> dict:
    """One single-thread worker per unit of each role, holding that role's resource."""
    workers, i = {}, 0
    for r, n in wf.roles.items():
        for _ in range(n):
            workers[f"{r}-{i}"] = {"cls": Worker, "options": {"nthreads": 1, "resources": role(r)}}
            i += 1
    return workers


def summarize(latencies: list[float]) -> dict:
    """Count, mean, P50, P95, P99 and max of ``latencies``.

    >>> summarize([1.0, 2.0, 3.0, 4.0])["p50"]
    3.0
    """
    xs = sorted(latencies)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]
    return {"n": len(xs), "avg": statistics.fmean(xs), "p50": q(0.50), "p95": q(0.95), "p99": q(0.99), "max": xs[-1]}


def _steal_outcomes(dask_scheduler) -> dict:
    """Steal requests by outcome (Dask's WorkStealing logs each to the ``stealing`` topic,
    whichever policy asked): ``confirm`` moved, ``already-computing`` refused by the victim."""
    out: dict = {}
    for _, msg in dask_scheduler.get_events("stealing"):
        for entry in msg if isinstance(msg, list) and msg and isinstance(msg[0], (list, tuple)) else [msg]:
            if isinstance(entry, (list, tuple)) and entry and isinstance(entry[0], str):
                out[entry[0]] = out.get(entry[0], 0) + 1
    return out


def _batching_stats(dask_worker) -> dict:
    plugin = dask_worker.plugins.get(BATCHING_WORKER_PLUGIN)
    return plugin.stats() if plugin is not None else {}


async def run_one(wf: Workflow, config: str, *, duration: float, seed: int, drain: float) -> dict:
    """``duration`` seconds of seeded arrivals of ``wf`` under ``config``, ``drain`` seconds allowed after."""
    policies, hinted = config.removesuffix("+hints"), config.endswith("+hints")
    settings: dict[str, object] = {f"kvstate.scheduling.{k}": v for k, v in CONFIGS[policies].items()}
    settings["kvstate.scheduling.components"] = {**wf.hints, **(wf.nalar_hints if hinted else {})}
    settings["distributed.scheduler.work-stealing"] = True  # the stock default
    arrivals = np.cumsum(np.random.default_rng([seed, 10**6]).exponential(1 / wf.rate, int(duration * wf.rate * 2)))
    arrivals = arrivals[arrivals < duration]
    fn = {"swe": swe, "analyst": analyst}.get(wf.name) or (
        lambda c, rid, d, t: router(c, rid, d, t, shift_until=0.4 * duration)
    )
    with dask.config.set(settings):
        async with (
            SpecCluster(
                workers=cluster_spec(wf),
                scheduler={"cls": Scheduler, "options": {"dashboard_address": None}},
                asynchronous=True,
            ) as cluster,
            Client(cluster, asynchronous=True) as c,
        ):
            if config != "default":
                await install_policies(c)
            latencies: list[float] = []
            t0, t_wall0 = time.perf_counter(), time.time()

            async def request(rid: int, t_arr: float) -> None:
                await asyncio.sleep(max(t_arr - (time.perf_counter() - t0), 0.0))
                await fn(c, rid, Draws(wf, seed, rid), t_arr)
                latencies.append(time.perf_counter() - t0 - t_arr)  # from the scheduled arrival

            jobs = [asyncio.ensure_future(request(i, float(t))) for i, t in enumerate(arrivals)]
            _, pending = await asyncio.wait(jobs, timeout=duration + drain)
            for j in pending:
                j.cancel()
            stats = await policy_stats(c) if config != "default" else {}
            batching = await c.run(_batching_stats) if hinted else {}
            steals = await c.run_on_scheduler(_steal_outcomes)
    out = {
        "workflow": wf.name,
        "config": config,
        "offered": len(arrivals),
        "unfinished": len(pending),
        **summarize(latencies),
        "steals": steals,
    }
    if stats and stats["hints"]["installed"]:
        h = stats["hints"]
        out["hints"] = {"peak": h["peak"], "holds": h.get("holds", 0)}
        sizes: dict = {}
        for w in batching.values():
            for size, n in w.get("sizes", {}).items():
                sizes[size] = sizes.get(size, 0) + n
        if sizes:
            out["hints"]["batch_sizes"] = dict(sorted(sizes.items()))
            out["hints"]["mean_batch"] = sum(k * n for k, n in sizes.items()) / sum(sizes.values())
    if stats:
        out["control_loop_ms"] = stats["sessions"]["control_loop"]["total"]
        out["moves"] = {k: stats[k].get("moves", 0) for k in ("stealing", "capacity") if stats[k]["installed"]}
        if stats["capacity"]["installed"]:
            out["units_end"] = stats["capacity"]["last"].get("units")
            out["capacity_moves"] = [
                (round(m["time"] - t_wall0, 1), m["from"], m["to"]) for m in stats["capacity"]["recent_moves"]
            ]
    return out


def run_repeats(wf: Workflow, configs: list[str], *, duration: float, seed: int, repeats: int, drain: float) -> dict:
    """Every config ``repeats`` times (seeds ``seed..``), interleaved; prints a line a run; config -> runs.

    Interleaved (every config once, then again), so a change in the machine's load
    during the experiment hits every config alike.
    """
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for rep in range(repeats):
        for config in runs:
            r = asyncio.run(run_one(wf, config, duration=duration, seed=seed + rep, drain=drain))
            runs[config].append(r)
            print(
                f"{wf.name:8s} {config:9s} seed={seed + rep} avg={r['avg']:.3f}s p99={r['p99']:.3f}s "
                f"max={r['max']:.3f}s unfinished={r['unfinished']} {r.get('moves', '')} steals={r['steals']} "
                f"loop={r.get('control_loop_ms', {})} {r.get('hints', '')}",
                flush=True,
            )
    return runs


def merge_runs(runs: list[dict]) -> dict:
    """One row per config: each latency statistic is the median over the repeats (seeds)."""
    if len(runs) == 1:
        return runs[0]
    row = dict(runs[-1])
    for k in ("n", "offered", "unfinished"):
        row[k] = sum(r[k] for r in runs)
    for k in ("avg", "p50", "p95", "p99", "max"):
        row[k] = statistics.median(r[k] for r in runs)
    row["runs"] = runs
    return row


def run(
    workflow: str = "swe",
    *,
    configs: str = DEFAULT_CONFIGS,
    duration: float = 40.0,
    drain: float = 120.0,
    rate: float | None = None,
    seed: int = 0,
    repeats: int = 1,
    roles: str | None = None,
    median: str | None = None,
    stateful: bool = False,
    out: str = "results/nalar",
) -> dict[str, list[dict]]:
    """``examples/nalar_workflows.py``: each workflow (``all``: every one) under ``configs``; workflow -> rows.

    Prints a line per run and a markdown table per workflow, and writes
    ``<out>/<workflow>.md``, ``.json`` and ``.png``. The overrides (``rate``, ``roles``,
    ``median``, ``stateful``) are those of :func:`~dask_kvstate.bench.nalar.workflows.configure`.
    """
    os.makedirs(out, exist_ok=True)
    results = {}
    for name in WORKFLOWS if workflow == "all" else [workflow]:
        wf = configure(name, rate=rate, stateful=stateful, roles=roles, median=median)
        runs = run_repeats(wf, configs.split(","), duration=duration, seed=seed, repeats=repeats, drain=drain)
        rows = results[name] = [merge_runs(rs) for rs in runs.values()]
        md = report.table(rows)
        print(md)
        command = (
            f"python examples/nalar_workflows.py --workflow {name} --duration {duration} "
            f"--seed {seed} --repeats {repeats}{' --stateful' if stateful else ''} "
            f"{f'--roles {roles} ' if roles else ''}{f'--median {median} ' if median else ''}"
            f"--configs {configs}"
        )
        report.write(out, wf, rows, md, command)
    return results
