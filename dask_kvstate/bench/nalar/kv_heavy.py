"""A KV-heavy SWE agent workflow with real KV (tiny-llama): where KV-aware scheduling has something to decide.

The components of :mod:`~dask_kvstate.bench.nalar.workflows` only sleep, so no policy can
win or lose by where a request's KV lives. Here every request is one ``kvs.session``
whose agents are LLM calls on real KV state:

* a *planner* prefills the request's own long context (``kvs.materialize``; the
  ticket number leads the text, so no block is shared between requests);
* 2-3 *developer* lanes each ``kvs.resume`` from that state with a short lane prompt
  and a few new tokens;
* a *tester* tool call per attempt (it sleeps, holds no KV) whose seeded outcome sends a
  failed lane back: the lane's conversation grows by its prompt, its answer and the
  report (``kvs.extend``) and the next attempt resumes from there (up to ``attempts``).

Requests arrive open-loop (Poisson); every arrival, lane count, test outcome and test
duration is drawn up front from a seed of (run seed, request id), so every configuration
replays the very same requests. The cluster is a ``LocalCluster`` of single-thread worker
processes, so a consumer away from its state's holder pulls the blocks over TCP or
recomputes them, as on a real cluster.

Configurations (:data:`CONFIGS`), all on the same requests: ``default`` (the KV store
and placement, stock Dask scheduling with its WorkStealing), ``naive`` (the same, each
submit with ``priority=`` the number of the request's calls already completed, what a
user would write by hand), ``kvstate`` (``kvs.install`` with the library's defaults) and
``all`` (scheduling and lifecycle explicitly on). For the first ``checked`` requests,
each lane's last answer is compared, token for token, with plain text replay
(``kvs.generate`` of the state's text and the prompt, no prefix cache) after the run;
a mismatch fails the run. ``python -m dask_kvstate.bench nalar-kv`` (``examples/nalar_kv.py``) runs it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import cast

import dask
import numpy as np
from distributed import Client, Future, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.bench.nalar.runner import merge_runs, summarize

#: ``kvs.install`` overrides per configuration (``naive`` adds its priorities at submit).
CONFIGS: dict[str, dict] = {
    "default": {"scheduling": False, "lifecycle": False},
    "naive": {"scheduling": False, "lifecycle": False},
    "kvstate": {},
    "all": {"scheduling": True, "lifecycle": True},
}
#: What a user could configure without the policies; ratios are against the better of them.
BASELINES = ("default", "naive")
DEFAULT_CONFIGS = ",".join(CONFIGS)


@dataclasses.dataclass
class Options:
    """One experiment's settings; ``python -m dask_kvstate.bench nalar-kv`` has a flag for each."""

    duration: float = dataclasses.field(default=30.0, metadata={"help": "seconds of arrivals"})
    rate: float = dataclasses.field(default=1.0, metadata={"help": "requests per second (Poisson)"})
    seed: int = dataclasses.field(default=0, metadata={"help": "the first seed of arrivals, outcomes and durations"})
    repeats: int = dataclasses.field(
        default=1, metadata={"help": "runs per config, interleaved; the table shows medians"}
    )
    configs: str = dataclasses.field(
        default=DEFAULT_CONFIGS, metadata={"help": f"comma-separated, of {','.join(CONFIGS)}"}
    )
    out: str | None = dataclasses.field(default=None, metadata={"help": "folder for kv.md and kv.json"})
    drain: float = dataclasses.field(default=90.0, metadata={"help": "seconds allowed after the last arrival"})
    workers: int = dataclasses.field(default=4, metadata={"help": "single-thread worker processes"})
    context_repeats: int = dataclasses.field(
        default=16, metadata={"help": "sentences of the planner's context (about 70 tokens each)"}
    )
    new_tokens: int = dataclasses.field(default=8, metadata={"help": "tokens a developer attempt generates"})
    attempts: int = dataclasses.field(
        default=3, metadata={"help": "developer attempts per lane at most (the last one passes)"}
    )
    pass_chance: float = dataclasses.field(
        default=0.5, metadata={"help": "the chance a tester run passes (the last attempt always passes)"}
    )
    tool_seconds: float = dataclasses.field(default=0.25, metadata={"help": "median tester duration (log-normal)"})
    checked: int = dataclasses.field(
        default=3, metadata={"help": "requests whose answers are compared with text replay"}
    )


@dataclasses.dataclass(frozen=True)
class Request:
    """One request, drawn in full before the run: arrival and, per lane and attempt, (passed, tester seconds)."""

    rid: int
    arrival: float
    lanes: tuple[tuple[tuple[bool, float], ...], ...]


def requests(opts: Options, seed: int) -> list[Request]:
    """The seeded requests of one run: the same for every configuration.

    >>> rs = requests(Options(duration=10.0, rate=1.0), seed=0)
    >>> rs == requests(Options(duration=10.0, rate=1.0), seed=0), all(2 <= len(r.lanes) <= 3 for r in rs)
    (True, True)
    """
    n = int(opts.duration * opts.rate * 2) + 10
    arrivals = np.cumsum(np.random.default_rng([seed, 10**6]).exponential(1 / opts.rate, n))
    out = []
    for rid, t in enumerate(arrivals[arrivals < opts.duration]):
        rng = np.random.default_rng([seed, rid])
        lanes = []
        for _ in range(int(rng.integers(2, 4))):
            lane = []
            for a in range(opts.attempts):
                passed = bool(rng.random() < opts.pass_chance) or a == opts.attempts - 1
                lane.append((passed, float(min(opts.tool_seconds * rng.lognormal(0.0, 0.5), 10 * opts.tool_seconds))))
                if passed:
                    break
            lanes.append(tuple(lane))
        out.append(Request(rid, float(t), tuple(lanes)))
    return out


def context(rid: int, repeats: int) -> str:
    """The planner's context: the request's own material, its ticket number first."""
    return f"Ticket {rid}. " + "".join(
        f"Step {s} of ticket {rid}: the parser in module m{rid} drops field {s} of record {rid * 7 + s} "
        "when the line ends without a newline, so the tests of the exporter fail. "
        for s in range(repeats)
    )


def lane_prompt(rid: int, lane: int, attempt: int) -> str:
    return f" Developer {lane}, attempt {attempt}: write the fix for part {lane} of ticket {rid}."


def report(rid: int, lane: int, attempt: int) -> str:
    return f" Tester: test_{rid}_{lane}_{attempt} failed, field {lane} is still missing."


def run_tests(seconds: float, passed: bool, answer: str) -> bool:
    """The tester tool: takes time, holds no KV; the answer is its input."""
    time.sleep(seconds)
    return passed


async def request(c: Client, req: Request, opts: Options, *, naive: bool, checks: list) -> None:
    """One request inside its session; appends ``(state text, prompt, token ids)`` of checked lanes to ``checks``."""
    done = 0  # the request's calls completed so far: the naive configuration's priority

    def completed(_: Future) -> None:
        nonlocal done
        done += 1

    def compute(*xs) -> list[Future]:
        futures = c.compute(list(xs), priority=done) if naive else c.compute(list(xs))
        for f in futures:
            f.add_done_callback(completed)
        return futures

    rid = req.rid
    with kvs.session(f"kv-{rid}", client=c):
        (plan,) = compute(kvs.materialize(context(rid, opts.context_repeats)))

        async def lane(k: int, attempts: tuple[tuple[bool, float], ...]) -> None:
            state: Future | object = plan  # the lane's conversation so far
            previous: tuple | None = None  # the last failed attempt: (prompt, answer future, report)
            for a, (passed, seconds) in enumerate(attempts):
                if previous is not None:
                    state = kvs.extend(state, *previous)
                prompt = lane_prompt(rid, k, a)
                answer = kvs.resume(state, prompt, max_new_tokens=opts.new_tokens)
                tested = dask.delayed(run_tests, pure=True)(
                    seconds, passed, answer, dask_key_name=f"tester-{rid}-{k}-{a}"
                )
                if previous is not None:
                    state, fa, ft = compute(state, answer, tested)
                else:
                    fa, ft = compute(answer, tested)
                if await ft:
                    if rid < opts.checked:
                        checks.append(((await cast(Future, state)).text, prompt, (await fa).token_ids))
                    return
                previous = (prompt, fa, report(rid, k, a))

        await asyncio.gather(*(lane(k, attempts) for k, attempts in enumerate(req.lanes)))


async def token_identity(c: Client, checks: list, new_tokens: int) -> bool:
    """Every checked answer equals plain text replay of its state's text and prompt (greedy)."""
    replays = c.compute(
        [kvs.generate(text, prompt, max_new_tokens=new_tokens, prefix_cache=False) for text, prompt, _ in checks]
    )
    return all(list(g.token_ids) == list(ids) for g, (_, _, ids) in zip(await c.gather(replays), checks))


def _dask_steals(dask_scheduler) -> int:
    ws = dask_scheduler.extensions.get("stealing")
    return 0 if ws is None else int(sum(ws.metrics["request_count_total"].values()))


def imbalance(stream: list[dict]) -> float:
    """The busiest worker's compute seconds over the mean worker's, from the task stream:
    1.0 is an even spread; KV locality alone piles a request's calls onto its state's holder.

    >>> imbalance([{"worker": "a", "startstops": [{"action": "compute", "start": 0, "stop": 3}]},
    ...            {"worker": "b", "startstops": [{"action": "compute", "start": 0, "stop": 1}]}])
    1.5
    """
    busy: dict[str, float] = {}
    for t in stream:
        spent = sum(s["stop"] - s["start"] for s in t["startstops"] if s["action"] == "compute")
        busy[t["worker"]] = busy.get(t["worker"], 0.0) + spent
    return max(busy.values()) / statistics.fmean(busy.values()) if busy else 1.0


def kv_counters(stats: kvs.Stats, dask_steals: int) -> dict:
    """What the KV-aware decisions were: placement's choices, blocks moved or rebuilt, moves, lifecycle."""
    placement, stealing, lifecycle = stats.placement, stats.scheduling["stealing"], stats.lifecycle
    priority, loop = stats.scheduling["priority"], stats.scheduling["sessions"].get("control_loop", {})
    total = lambda k: sum(int(w.get(k, 0)) for w in stats.workers.values())
    return {
        "placed": placement.get("decisions", 0),
        "chose_pull": placement.get("chose_pull", 0),
        "chose_recompute": placement.get("chose_recompute", 0),
        "blocks_pulled": total("transfers"),
        "blocks_recomputed": total("recomputes"),
        "reused_tokens": total("reused_tokens"),
        "prefill_tokens": total("prefill_tokens"),
        "reprioritised": sum(priority.get(k, 0) for k in ("queued_revised", "scheduler_revised", "worker_revised")),
        "control_loop_ms": loop.get("total", {}).get("mean_ms", 0.0),
        "kv_moves": stealing.get("moves", 0),
        "dask_steals": dask_steals,
        "offloads": lifecycle.get("offload", 0),
        "prefetches": lifecycle.get("prefetch", 0),
    }


async def run_config(name: str, opts: Options, seed: int) -> dict:
    """One configuration over the seeded requests: a row of latency statistics, KV counters and the check."""
    reqs = requests(opts, seed)
    settings = {"kvstate.block-tokens": 16, "distributed.scheduler.work-stealing": True}
    with dask.config.set(settings):
        cluster = LocalCluster(n_workers=opts.workers, threads_per_worker=1, dashboard_address=":0", asynchronous=True)
        async with cluster, Client(cluster, asynchronous=True) as c:  # worker processes, the default
            await cast(Awaitable[dict], kvs.install(c, "tiny-llama", torch_threads=1, **CONFIGS[name]))
            # Every worker runs the model once, and the tester once, before the clock starts.
            await c.wait_for_workers(opts.workers)
            warm = [c.compute(kvs.generate(f"Warm-up {w}.", max_new_tokens=2), workers=[w]) for w in await c.nthreads()]
            await c.gather([*warm, c.submit(run_tests, opts.tool_seconds, True, "", key="tester-warm")])
            del warm
            latencies: list[float] = []
            checks: list = []
            await c.get_task_stream(count=0)  # the scheduler records the task stream from here
            t0, t_wall0 = time.perf_counter(), time.time()

            async def timed(req: Request) -> None:
                await asyncio.sleep(max(req.arrival - (time.perf_counter() - t0), 0.0))
                await request(c, req, opts, naive=name == "naive", checks=checks)
                latencies.append(time.perf_counter() - t0 - req.arrival)  # from the scheduled arrival

            jobs = [asyncio.ensure_future(timed(r)) for r in reqs]
            _, pending = await asyncio.wait(jobs, timeout=opts.duration + opts.drain)
            for j in pending:
                j.cancel()
            stats = await cast(Awaitable[kvs.Stats], kvs.stats(c))
            steals = await c.run_on_scheduler(_dask_steals)
            spread = imbalance(await c.get_task_stream(start=t_wall0))
            identical = await token_identity(c, checks, opts.new_tokens) if checks else True
    return {
        "workflow": "kv",
        "config": name,
        "offered": len(reqs),
        "unfinished": len(pending),
        **summarize(latencies or [float("nan")]),
        "token_identical": identical,
        "checked": len(checks),
        "kv": {**kv_counters(stats, steals), "imbalance": spread},
    }


def merge(runs: list[dict]) -> dict:
    """One row per config: :func:`~dask_kvstate.bench.nalar.runner.merge_runs`, with the KV
    counters' medians and the token check of every run."""
    row = merge_runs(runs)
    row["kv"] = {k: statistics.median(r["kv"][k] for r in runs) for k in runs[0]["kv"]}
    row["token_identical"] = all(r["token_identical"] for r in runs)
    row["checked"] = sum(r["checked"] for r in runs)
    return row


def table(rows: list[dict]) -> str:
    """The markdown table: each config's latencies, ratios against the best baseline, KV decisions."""
    base = [r for r in rows if r["config"] in BASELINES]
    best_avg = min((r["avg"] for r in base), default=None)
    best_p99 = min((r["p99"] for r in base), default=None)
    # As the harness's tables: the best baseline's average over the row's (above 1: faster),
    # and the row's P99 change against the best baseline's (negative: lower).
    ratio = lambda v, b: "-" if b is None else f"{b / v:.2f}x"
    change = lambda v, b: "-" if b is None else f"{100 * (v / b - 1):+.0f}%"
    head = (
        "| config | n/offered | unfinished | avg s | P50 s | P95 s | P99 s | max s | avg vs best baseline | "
        "P99 vs best baseline | placed (pull/recompute) | blocks pulled | blocks recomputed | KV moves | "
        "Dask steal requests | offloads | busiest worker vs mean | token identical |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        kv = r["kv"]
        cells = [r["config"], f"{r['n']}/{r['offered']}", r["unfinished"]]
        cells += [f"{r[k]:.3f}" for k in ("avg", "p50", "p95", "p99", "max")]
        cells += [ratio(r["avg"], best_avg), change(r["p99"], best_p99)]
        cells.append(f"{kv['placed']:.0f} ({kv['chose_pull']:.0f}/{kv['chose_recompute']:.0f})")
        cells += [f"{kv[k]:.0f}" for k in ("blocks_pulled", "blocks_recomputed", "kv_moves", "dask_steals", "offloads")]
        cells += [f"{kv['imbalance']:.2f}", f"{r['token_identical']} ({r['checked']})"]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


def run(opts: Options) -> list[dict]:
    """Every config of ``opts.configs``, ``opts.repeats`` times interleaved (seeds ``seed..``); one row each.

    Prints a line a run and the table, writes ``<out>/kv.md`` and ``kv.json``, then raises
    RuntimeError if any answer differed from text replay.
    """
    names = opts.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise ValueError(f"unknown config(s) {unknown}; known: {list(CONFIGS)}")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(opts.repeats):  # interleaved, so a change in the machine's load hits every config alike
        for name in runs:
            r = asyncio.run(run_config(name, opts, opts.seed + rep))
            runs[name].append(r)
            print(
                f"kv {name:8s} seed={opts.seed + rep} avg={r['avg']:.3f}s p99={r['p99']:.3f}s "
                f"unfinished={r['unfinished']} identical={r['token_identical']} {r['kv']}",
                flush=True,
            )
    rows = [merge(rs) for rs in runs.values()]
    text = table(rows)
    print(text)
    if opts.out:
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kv.md").write_text(text + "\n")
        (out / "kv.json").write_text(json.dumps({"args": dataclasses.asdict(opts), "rows": rows}, indent=1))
    wrong = [r["config"] for r in rows if not r["token_identical"]]
    if wrong:
        raise RuntimeError(f"KV reuse was not token-identical to text replay under {wrong}")
    return rows
