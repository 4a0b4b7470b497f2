"""One run of a Nalar workflow under one configuration, the repeats that make a table row, the grid.

A run starts an in-process ``SpecCluster`` of role workers (by default single-thread,
one unit of one role each), replays the seeded open-loop arrivals of
:mod:`~dask_kvstate.bench.nalar.workflows`, and returns the end-to-end latency
statistics with what the policies and Dask's stealing did. Configurations: the
baselines of :mod:`~dask_kvstate.bench.nalar.baselines` (``default``, ``naive``,
``static-best``: stock Dask, WorkStealing on, nothing of ours), ``kvstate`` (the
library's defaults), each mechanism alone, pairs and ``all``; a ``+hints`` suffix adds
the workflow's component hints.
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
from distributed import Client, Scheduler, SpecCluster, Worker

import dask_kvstate as kvs
from dask_kvstate.bench.nalar import report
from dask_kvstate.bench.nalar.baselines import BASELINES, grid_candidates, offered_load
from dask_kvstate.bench.nalar.workflows import (
    WORKFLOWS,
    Draws,
    Request,
    Workflow,
    arrival_times,
    configure,
    kind_of,
    role,
    with_split,
)
from dask_kvstate.protocol import BATCHING_WORKER_PLUGIN


def _only(*mechanisms: str) -> dict[str, bool]:
    """Each of priority, stealing and capacity set explicitly, so an ablation means the same
    whatever the library's defaults are."""
    return {f"{m}.enabled": m in mechanisms for m in ("priority", "stealing", "capacity")}


CONFIGS = {
    # the baselines: stock Dask, nothing installed (a "+hints" row installs the hints alone)
    "default": _only(),
    "naive": _only(),
    "static-best": _only(),
    "kvstate": {},  # kvs.install with the library's defaults, no override
    "priority": _only("priority"),
    "stealing": _only("stealing"),
    "capacity": _only("capacity"),
    "all": _only("priority", "stealing", "capacity"),
    # pairs, for ablations (not in the default set)
    "capacity+stealing": _only("capacity", "stealing"),
    "capacity+priority": _only("capacity", "priority"),
}
DEFAULT_CONFIGS = "default,naive,static-best,kvstate,all"


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
    """``wf.workers``' layout (a thread per unit, at least one), or one single-thread worker per unit of each role."""
    if wf.workers is not None:
        return {
            f"w{i}": {
                "cls": Worker,
                "options": {
                    "nthreads": max(1, sum(units.values())),
                    "resources": {f"role:{r}": n for r, n in units.items() if n},
                },
            }
            for i, units in enumerate(wf.workers)
        }
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
    if not xs:
        return dict.fromkeys(("avg", "p50", "p95", "p99", "max"), float("nan")) | {"n": 0}
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
    """``duration`` seconds of seeded arrivals of ``wf`` under ``config``, ``drain`` seconds allowed after.

    A baseline config runs stock Dask (``static-best`` is ``default`` on the split the
    caller gives ``wf``); every other config, and any ``+hints`` one, runs ``kvs.install``.
    """
    policies, hinted = config.removesuffix("+hints"), config.endswith("+hints")
    installed = hinted or policies not in BASELINES
    settings: dict[str, object] = {f"kvstate.scheduling.{k}": v for k, v in CONFIGS[policies].items()}
    settings["kvstate.scheduling.components"] = {**wf.hints, **(wf.nalar_hints if hinted else {})}
    settings["distributed.scheduler.work-stealing"] = True  # the stock default
    arrivals = arrival_times(wf, duration, seed)
    kind = kind_of(wf)
    with dask.config.set(settings):
        async with (
            SpecCluster(
                workers=cluster_spec(wf),
                # no dashboard, and its HTTP server on a free port (8787 may be another cluster's)
                scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0", "dashboard": False}},
                asynchronous=True,
            ) as cluster,
            Client(cluster, asynchronous=True) as c,
        ):
            if installed:
                await install_policies(c)
            latencies: list[float] = []
            t0, t_wall0 = time.perf_counter(), time.time()

            async def request(rid: int, t_arr: float) -> None:
                await asyncio.sleep(max(t_arr - (time.perf_counter() - t0), 0.0))
                plan = kind.plan(Draws(wf, seed, rid), t_arr, duration)
                await kind.request(Request(c, wf, rid, naive=policies == "naive"), plan)
                latencies.append(time.perf_counter() - t0 - t_arr)  # from the scheduled arrival

            jobs = [asyncio.ensure_future(request(i, float(t))) for i, t in enumerate(arrivals)]
            _, pending = await asyncio.wait(jobs, timeout=duration + drain)
            for j in pending:
                j.cancel()
            stats = await policy_stats(c) if installed else {}
            batching = await c.run(_batching_stats) if hinted else {}
            steals = await c.run_on_scheduler(_steal_outcomes)
    out = {
        "workflow": wf.name,
        "config": config,
        "offered": len(arrivals),
        "unfinished": len(pending),
        **summarize(latencies),
        "steals": steals,
        "roles": dict(wf.roles),
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
        if stats["stealing"]["installed"]:
            st = stats["stealing"]
            out["late_binding"] = {
                k: st.get(k, 0)
                for k in ("continuation_kept", "continuation_taken", "continuation_expired", "placed_by_inputs")
            }
        if stats["capacity"]["installed"]:
            out["units_end"] = stats["capacity"]["last"].get("units")
            out["capacity_moves"] = [
                (round(m["time"] - t_wall0, 1), m["from"], m["to"]) for m in stats["capacity"]["recent_moves"]
            ]
    return out


def _line(wf: Workflow, label: str, seed: int, r: dict) -> str:
    return (
        f"{wf.name:8s} {label:11s} seed={seed} avg={r['avg']:.3f}s p99={r['p99']:.3f}s "
        f"max={r['max']:.3f}s unfinished={r['unfinished']} {r.get('moves', '')} steals={r['steals']} "
        f"loop={r.get('control_loop_ms', {})} {r.get('hints', '')}"
    )


def run_repeats(
    wf: Workflow,
    configs: list[str],
    *,
    duration: float,
    seed: int,
    repeats: int,
    drain: float,
    variants: dict[str, Workflow] | None = None,
) -> dict:
    """Every config ``repeats`` times (seeds ``seed..``), interleaved; prints a line a run; config -> runs.

    Interleaved (every config once, then again), so a change in the machine's load
    during the experiment hits every config alike. ``variants`` gives a config its own
    workflow (``static-best``: its split).
    """
    variants = variants or {}
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for rep in range(repeats):
        for config in runs:
            r = asyncio.run(run_one(variants.get(config, wf), config, duration=duration, seed=seed + rep, drain=drain))
            runs[config].append(r)
            print(_line(wf, config, seed + rep, r), flush=True)
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


def grid_search(
    wf: Workflow, *, seeds: list[int], duration: float, grid_duration: float, drain: float, grid_max: int
) -> dict:
    """``static-best`` in hindsight: run each candidate split of ``wf``'s role units with stock Dask.

    The candidates are :func:`~dask_kvstate.bench.nalar.baselines.grid_candidates` of the
    load the ``duration`` seconds of arrivals offer; each runs ``grid_duration`` seconds
    on every seed. The best has the lowest median avg latency (ties: P99), among those
    that finished every request where any did: a latency over the finished ones only
    would flatter a split that falls behind. Returns the offered load, every candidate's
    result (``grid``) and the best (with its runs).
    """
    load = offered_load(wf, duration, seeds)
    candidates = grid_candidates(load, sum(wf.roles.values()), grid_max)
    print(f"{wf.name:8s} grid: offered units { ({r: round(u, 2) for r, u in load.items()}) }, {len(candidates)} splits")
    grid = []
    for i, (split, util) in enumerate(candidates):
        runs = []
        for seed in seeds:
            r = asyncio.run(
                run_one(with_split(wf, split), "static-best", duration=grid_duration, seed=seed, drain=drain)
            )
            runs.append(r)
            label = f"grid {i + 1}/{len(candidates)}"
            print(f"{_line(wf, label, seed, r)} split={report.split_name(split)} max-util={util:.2f}", flush=True)
        row = merge_runs(runs)
        grid.append({"split": split, "max_util": util, **{k: row[k] for k in ("avg", "p99", "unfinished")}})
        grid[-1]["runs"] = runs
    best = min(grid, key=lambda g: (g["unfinished"] > 0, g["avg"], g["p99"]))
    return {"offered": load, "duration": grid_duration, "grid": grid, "best": best}


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
    grid_max: int = 10,
    grid_duration: float | None = None,
    out: str = "results/nalar",
) -> dict[str, list[dict]]:
    """Each workflow (``all``: every one) under ``configs``; workflow -> rows (``... bench nalar-workflows``).

    Prints a line per run and a markdown table per workflow, and writes
    ``<out>/<workflow>.md``, ``.json`` and ``.png``. The overrides (``rate``, ``roles``,
    ``median``, ``stateful``) are those of :func:`~dask_kvstate.bench.nalar.workflows.configure`;
    ``static-best`` runs :func:`grid_search` first (``grid_max`` splits of ``grid_duration``
    seconds, default ``duration``) and is skipped, with a line saying so, for a role-free workflow.
    """
    os.makedirs(out, exist_ok=True)
    grid_duration = grid_duration or duration
    seeds = [seed + rep for rep in range(repeats)]
    results = {}
    for name in WORKFLOWS if workflow == "all" else [workflow]:
        wf = configure(name, rate=rate, stateful=stateful, roles=roles, median=median)
        names, variants, grid = configs.split(","), {}, None
        if "static-best" in names and not wf.roles:
            print(f"{name:8s} static-best skipped: {name} is role-free, it has no role split to search")
            names.remove("static-best")
        elif "static-best" in names:
            grid = grid_search(
                wf, seeds=seeds, duration=duration, grid_duration=grid_duration, drain=drain, grid_max=grid_max
            )
            # Run again among the configs, not taken from the grid: the grid runs first,
            # and a drift in the machine's load would land on one side only.
            variants["static-best"] = with_split(wf, grid["best"]["split"])
        runs = run_repeats(wf, names, duration=duration, seed=seed, repeats=repeats, drain=drain, variants=variants)
        rows = results[name] = [merge_runs(rs) for rs in runs.values()]
        if grid is not None:
            row = next(r for r in rows if r["config"] == "static-best")
            row["grid"] = [{k: v for k, v in g.items() if k != "runs"} for g in grid["grid"]]
            row["offered_units"], row["grid_duration"] = grid["offered"], grid["duration"]
        md = report.table(rows)
        print(f"{report.best_line(rows)}\n{md}\n{report.grid_table(rows)}")
        command = (
            f"python -m dask_kvstate.bench nalar-workflows --workflow {name} --duration {duration} "
            f"--seed {seed} --repeats {repeats}{' --stateful' if stateful else ''} "
            f"{f'--roles {roles} ' if roles else ''}{f'--median {median} ' if median else ''}"
            f"--grid-max {grid_max} --grid-duration {grid_duration} --configs {configs}"
        )
        report.write(out, wf, rows, md, command, first_seed=seed)
    return results
