"""Nalar's three agent workflows on Dask, with and without workflow-aware scheduling.

Each workflow is ordinary Python over futures: one coroutine per request, inside
``kvs.session``, submitting components as tasks that ask for their agent role
(``resources={"role:developer": 1}``). Components sleep for durations drawn from seeded
heavy-tailed (log-normal) profiles, so a run needs no CPU and one process holds many
single-thread workers, one unit of one role each. Requests arrive open-loop (Poisson,
seeded), and every configuration replays the very same arrivals, durations and test
outcomes, so the rows of the table differ only in scheduling.

* ``swe``: planner -> 3 developers -> a tester each; a failed test goes back to the
  same developer lane (up to 4 attempts). A developer attempt that lands on another
  worker than the lane's previous one pays a context rebuild (half a median call: its
  KV is elsewhere). The previous attempt's result is its input, and that result's
  ``dask.sizeof`` is the KV bytes a move would carry (as for ``KVStateRef``), so Dask
  and the policies see the price of moving through the usual transfer estimate. With
  ``--stateful`` the developer gets Nalar's ``stateful`` hint, and its retries keep
  session affinity (never migrated).
* ``analyst``: financial analyst, fan-out to 4 analysts, a summary, and half of the
  requests come back after a think time with a follow-up (2 analysts, a summary).
* ``router``: a classifier routes to ``chat`` or ``code``; the share of code grows
  from 50% to 95% over the first 40% of the arrivals and stays there.

Configurations: ``default`` (stock Dask, WorkStealing on, nothing of ours), each
mechanism alone (``priority``, ``stealing``, ``capacity``) and ``all``. Roles start
evenly split (the allocation one would write without profiling the workflow).
A ``+hints`` suffix (``default+hints``, ``all+hints``) adds the workflow's Nalar
component hints (Table 2): in ``router`` the classifier is ``batchable`` (ready
classifications on a router worker run as one call, which costs its longest element
plus a quarter of each other one: batched decoding's price, see ``graph_opt/batch.py``);
in ``swe`` the tester is a pool of 3 sandboxes (``max-concurrency: 3``: at most three
test runs at once, cluster-wide; the rest wait on the scheduler, holding no thread).

Run::

    python examples/nalar_workflows.py --workflow swe --out results/nalar
    python examples/nalar_workflows.py --control-loop 10000   # control loop latency
    python examples/nalar_workflows.py --workflow router --configs default,default+hints   # batching

It prints a markdown table (avg, P50, P95, P99, max end-to-end latency in seconds)
and writes ``<out>/<workflow>.md``, ``<out>/<workflow>.json`` and ``<out>/<workflow>.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, field

import dask
import numpy as np
from dask.sizeof import sizeof
from distributed import Client, Scheduler, SpecCluster, Worker, get_worker

import dask_kvstate as kvs
from dask_kvstate.client import _scheduling_stats

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


# -- components: sleep, never compute ------------------------------------------------------
def work(seconds: float, *deps) -> float:
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


# -- seeded profiles ---------------------------------------------------------------------------
@dataclass
class Workflow:
    name: str
    roles: dict[str, int]  # role -> worker units at start (even split)
    rate: float  # requests per second
    components: dict = field(default_factory=dict)  # component -> (median seconds, sigma)
    hints: dict = field(default_factory=dict)
    stateful: dict = field(default_factory=dict)  # hints applied only with --stateful
    nalar_hints: dict = field(default_factory=dict)  # component hints of the "+hints" configs


WORKFLOWS = {
    "swe": Workflow(
        "swe",
        {"planner": 4, "developer": 4, "tester": 4},
        rate=7.0,
        components={"planner": (0.05, 0.8), "developer": (0.10, 0.8), "tester": (0.06, 0.8)},
        stateful={"developer": {"stateful": True}},
        nalar_hints={"tester": {"max-concurrency": 3}},
    ),
    "analyst": Workflow(
        "analyst",
        {"analyst": 6, "summarizer": 2},
        rate=7.0,
        components={"analyst": (0.08, 1.0), "summarizer": (0.06, 0.8)},
    ),
    "router": Workflow(
        "router",
        {"router": 2, "chat": 5, "code": 5},
        rate=20.0,
        components={"router": (0.02, 0.8), "chat": (0.12, 0.8), "code": (0.20, 0.8)},
        nalar_hints={"router": {"batchable": True, "max-batch": 16}},
    ),
}


class Draws:
    """Per-request random numbers, drawn in a fixed order from a seed of (run seed, request)."""

    def __init__(self, wf: Workflow, seed: int, rid: int):
        self.rng = np.random.default_rng([seed, rid])
        self.wf = wf

    def seconds(self, component: str) -> float:
        median, sigma = self.wf.components[component]
        return float(min(median * self.rng.lognormal(0.0, sigma), 50 * median))  # 1 ms .. seconds

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)


def role(name: str) -> dict:
    return {f"role:{name}": 1}


# -- the three workflows: ordinary Python over futures -------------------------------------------
async def swe(c: Client, rid: int, d: Draws, t_arr: float) -> None:
    rebuild = 0.5 * WORKFLOWS["swe"].components["developer"][0]
    plan_s = d.seconds("planner")
    # Every lane's attempts are drawn up front, in order: the draws never depend on timing.
    lanes = [
        [(d.seconds("developer"), d.chance(0.65) or a == 3, d.seconds("tester")) for a in range(4)] for _ in range(3)
    ]
    with kvs.session(f"swe-{rid}"):
        plan = c.submit(work, plan_s, key=f"planner-{rid}", resources=role("planner"))

        async def lane(k: int) -> None:
            previous = None  # the last attempt's future: its context is the next attempt's input
            for attempt, (dev_s, passed, test_s) in enumerate(lanes[k]):
                dev = c.submit(
                    develop,
                    dev_s,
                    rebuild,
                    previous,
                    plan,
                    key=f"developer-{rid}-{k}-{attempt}",
                    resources=role("developer"),
                )
                ok = c.submit(
                    run_tests, test_s, passed, dev, key=f"tester-{rid}-{k}-{attempt}", resources=role("tester")
                )
                if await ok:
                    return
                previous = dev

        await asyncio.gather(*(lane(k) for k in range(3)))


async def analyst(c: Client, rid: int, d: Draws, t_arr: float) -> None:
    with kvs.session(f"analyst-{rid}"):
        views = [
            c.submit(work, d.seconds("analyst"), key=f"analyst-{rid}-{i}", resources=role("analyst")) for i in range(4)
        ]
        await c.submit(work, d.seconds("summarizer"), *views, key=f"summarizer-{rid}", resources=role("summarizer"))
        if d.chance(0.5):
            think = d.seconds("summarizer") * 8
            await asyncio.sleep(think)
            more = [
                c.submit(work, d.seconds("analyst"), key=f"analyst-{rid}-f{i}", resources=role("analyst"))
                for i in range(2)
            ]
            await c.submit(
                work, d.seconds("summarizer"), *more, key=f"summarizer-{rid}-f", resources=role("summarizer")
            )


async def router(c: Client, rid: int, d: Draws, t_arr: float, *, shift_until: float) -> None:
    with kvs.session(f"router-{rid}"):
        p_code = 0.5 + 0.45 * min(t_arr / shift_until, 1.0)
        branch = "code" if d.chance(p_code) else "chat"
        label = c.submit(classify, d.seconds("router"), key=f"router-{rid}", resources=role("router"))
        await c.submit(work, d.seconds(branch), label, key=f"{branch}-{rid}", resources=role(branch))


# -- one run -----------------------------------------------------------------------------------------
def cluster_spec(wf: Workflow) -> dict:
    workers, i = {}, 0
    for r, n in wf.roles.items():
        for _ in range(n):
            workers[f"{r}-{i}"] = {"cls": Worker, "options": {"nthreads": 1, "resources": role(r)}}
            i += 1
    return workers


def summarize(latencies: list[float]) -> dict:
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
    plugin = dask_worker.plugins.get("kvstate-batching")
    return plugin.stats() if plugin is not None else {}


async def run_one(wf: Workflow, config: str, *, duration: float, seed: int, drain: float) -> dict:
    policies, hinted = config.removesuffix("+hints"), config.endswith("+hints")
    settings = {f"kvstate.scheduling.{k}": v for k, v in CONFIGS[policies].items()}
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
                await kvs.install_scheduling(c)
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
            stats = await c.run_on_scheduler(_scheduling_stats) if config != "default" else {}
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


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["config"] == "default"), None)
    lines = [
        "| workflow | config | requests | unfinished | avg s | P50 s | P95 s | P99 s | max s | avg vs default | P99 vs default |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{base['avg'] / r['avg']:.2f}x" if base else "-"
        p99 = f"{100 * (1 - r['p99'] / base['p99']):+.0f}%".replace("+", "-", 1) if base and r is not base else "-"
        if base and r is not base and r["p99"] > base["p99"]:
            p99 = f"+{100 * (r['p99'] / base['p99'] - 1):.0f}%"
        lines.append(
            f"| {r['workflow']} | {r['config']} | {r['n']}/{r['offered']} | {r['unfinished']} | {r['avg']:.3f} | "
            f"{r['p50']:.3f} | {r['p95']:.3f} | {r['p99']:.3f} | {r['max']:.3f} | {ratio} | {p99} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["avg", "p50", "p95", "p99"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ax.bar([m + i * width for m in range(len(metrics))], [r[k] for k in metrics], width, label=r["config"])
    ax.set_xticks([m + 0.4 - width / 2 for m in range(len(metrics))], metrics)
    ax.set_ylabel("end-to-end latency (s)")
    ax.set_title(f"{rows[0]['workflow']}: {rows[0]['offered']} requests, open loop")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the control loop under 10,000 queued futures ---------------------------------------------------------
def _loop_state(dask_scheduler, reset: bool = False) -> dict:
    loop = dask_scheduler.plugins["kvstate-sessions"].loop
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
    out = {"futures": n_futures, "seconds": seconds}
    for phase in ("role-restricted, queued on workers", "root-ish, queued on the scheduler"):
        with dask.config.set(settings):
            async with (
                SpecCluster(
                    workers=cluster_spec(wf),
                    asynchronous=True,
                    scheduler={"cls": Scheduler, "options": {"dashboard_address": None}},
                ) as cluster,
                Client(cluster, asynchronous=True) as c,
            ):
                await kvs.install_scheduling(c)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workflow", choices=[*WORKFLOWS, "all"], default="swe")
    ap.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="comma-separated, of " + ",".join(CONFIGS) + "; a +hints suffix adds the component hints",
    )
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    ap.add_argument("--drain", type=float, default=120.0, help="seconds allowed after the last arrival")
    ap.add_argument("--rate", type=float, default=None, help="requests per second (default: the workflow's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="seeds seed..seed+repeats-1, interleaved; medians")
    ap.add_argument("--roles", default=None, help="units per role at start, e.g. planner=1,developer=7,tester=4")
    ap.add_argument("--median", default=None, help="median seconds per component call, e.g. router=0.06")
    ap.add_argument(
        "--stateful",
        action="store_true",
        help="mark swe's developer stateful: its retries keep session affinity (Nalar's stateful hint)",
    )
    ap.add_argument("--out", default="results/nalar")
    ap.add_argument("--control-loop", type=int, default=0, metavar="N", help="measure the loop with N queued futures")
    args = ap.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)  # cluster start/stop chatter, per run
    os.makedirs(args.out, exist_ok=True)
    if args.control_loop:
        res = asyncio.run(control_loop(args.control_loop, seconds=5.0))
        print(json.dumps(res, indent=1))
        with open(os.path.join(args.out, "control_loop.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    for name in WORKFLOWS if args.workflow == "all" else [args.workflow]:
        wf = WORKFLOWS[name]
        if args.rate:
            wf.rate = args.rate
        if args.stateful:
            wf.hints = {**wf.hints, **wf.stateful}
        if args.roles:
            units = {k: int(v) for k, v in (kv.split("=") for kv in args.roles.split(","))}
            if set(units) != set(wf.roles):
                raise ValueError(f"--roles must give every role of {name}: {sorted(wf.roles)}, got {sorted(units)}")
            wf.roles = units
        if args.median:
            for comp, sec in (kv.split("=") for kv in args.median.split(",")):
                if comp not in wf.components:
                    raise ValueError(f"--median: {name} has no component {comp!r}; it has {sorted(wf.components)}")
                wf.components[comp] = (float(sec), wf.components[comp][1])
        runs: dict[str, list[dict]] = {c: [] for c in args.configs.split(",")}
        # Repeats are interleaved (every config once, then again), so a change in the
        # machine's load during the experiment hits every config alike.
        for rep in range(args.repeats):
            for config in runs:
                r = asyncio.run(run_one(wf, config, duration=args.duration, seed=args.seed + rep, drain=args.drain))
                runs[config].append(r)
                print(
                    f"{name:8s} {config:9s} seed={args.seed + rep} avg={r['avg']:.3f}s p99={r['p99']:.3f}s "
                    f"max={r['max']:.3f}s unfinished={r['unfinished']} {r.get('moves', '')} steals={r['steals']} "
                    f"loop={r.get('control_loop_ms', {})} {r.get('hints', '')}",
                    flush=True,
                )
        rows = [merge_runs(rs) for rs in runs.values()]
        md = table(rows)
        print(md)
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            f.write(
                f"Command: python examples/nalar_workflows.py --workflow {name} --duration {args.duration} "
                f"--seed {args.seed} --repeats {args.repeats}{' --stateful' if args.stateful else ''} "
                f"{f'--roles {args.roles} ' if args.roles else ''}{f'--median {args.median} ' if args.median else ''}"
                f"--configs {args.configs}; "
                f"rate {wf.rate}/s; "
                f"roles at start {wf.roles}; hints {wf.hints}; +hints rows add {wf.nalar_hints}\n\n{md}\n"
            )
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(rows, f, indent=1)
        plot(rows, os.path.join(args.out, f"{name}.png"))


if __name__ == "__main__":
    main()
