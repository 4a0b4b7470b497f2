"""KV lifecycle by workflow progress vs an LRU-only store, with real KV (tiny-llama).

An emulated SWE agent workflow: each session (a developer agent) materializes its own
conversation, then repeats *run the tests* (a tool call that sleeps for a seeded,
log-normal duration and uses no KV) -> *resume from the conversation with the test
report* -> *extend the conversation with report and answer*. Every repeat is a new
invocation: the client keeps only the new state's ``KVStateRef`` value and releases
its futures, as an agent loop does between turns, so between invocations only the
session (or nothing) keeps the KV. Sessions arrive staggered (at most ``live`` at a
time) and end after ``rounds`` invocations.

The one worker's device tier is smaller than the live sessions' KV and its host tier
is empty, so everything that leaves the device goes to the disk tier (raw bytes and a
checksum per block): on a CPU machine that is where resume latency differs, besides
recomputes. Three configurations replay the very same sessions, durations and texts:

* ``resident``: device budget large enough for everything, lifecycle off (the baseline);
* ``lru``: the small budgets, the store's own eviction score only (lifecycle off);
* ``lifecycle``: the small budgets with ``kvstate.lifecycle.enabled``.

Before the sessions, the scheduler sees one test run (steady state: the prediction
needs a history; ``cold`` skips it). :func:`run_config` reports per configuration:
median and P90 resume latency (time to first token of the resume task, which includes
reading the state's blocks), resumes that found their KV offloaded-then-prefetched (and
their median), recomputed blocks and tokens, peak device bytes, and the KV bytes left by
ended sessions. ``python -m dask_kvstate.bench kv-lifecycle`` (``examples/kv_lifecycle.py``)
and the asv suite ``kv_lifecycle`` call :func:`run`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import statistics
import time

import dask
import numpy as np
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.protocol import LIFECYCLE_TOPIC, SESSION_ANNOTATION, SESSION_TOPIC, WORKER_PLUGIN
from dask_kvstate.session import new_session_id


@dataclasses.dataclass
class Options:
    """One experiment's settings; ``python -m dask_kvstate.bench kv-lifecycle`` has a flag for each."""

    sessions: int = dataclasses.field(default=8, metadata={"help": "developer-agent sessions in all"})
    live: int = dataclasses.field(default=4, metadata={"help": "sessions running at once"})
    rounds: int = dataclasses.field(default=3, metadata={"help": "test-and-retry invocations per session"})
    tool_seconds: float = dataclasses.field(default=0.8, metadata={"help": "median test-run duration"})
    new_tokens: int = dataclasses.field(default=8, metadata={"help": "tokens each resume generates"})
    block_tokens: int = dataclasses.field(default=16, metadata={"help": "tokens per KV block"})
    device_bytes: int = dataclasses.field(default=1024 * 1024, metadata={"help": "device tier budget (small configs)"})
    disk_bytes: int = dataclasses.field(default=1024 * 1024, metadata={"help": "disk tier budget (small configs)"})
    seed: int = dataclasses.field(
        default=0, metadata={"help": "seed of the test-run durations (run r of --repeats: seed + r)"}
    )
    configs: str = dataclasses.field(
        default="resident,lru,lifecycle", metadata={"help": "comma-separated, of resident, lru and lifecycle"}
    )
    out: str | None = dataclasses.field(default=None, metadata={"help": "folder for lifecycle.md and lifecycle.json"})
    cold: bool = dataclasses.field(
        default=False, metadata={"help": "no tester run before the sessions: no history to predict from"}
    )
    repeats: int = dataclasses.field(
        default=1, metadata={"help": "runs per config, interleaved; the table shows medians"}
    )


SYSTEM = (
    "You are a careful software developer. Read the failing test report, explain the bug in one sentence "
    "and write the fix. Keep the style of the repository and do not change unrelated code. "
)


def run_tests(seconds: float, report: str) -> str:
    """The tester tool: takes time, holds no KV."""
    time.sleep(seconds)
    return report


def conversation(i: int) -> str:
    # The session's own material first, so no two sessions share a block.
    return (
        f"Ticket {i}: the parser in module m{i} drops the last field of every record when line {i * 7} "
        f"ends without a newline. "
    ) * 6 + SYSTEM


def _store_blocks(hashes, dask_worker=None) -> dict:
    store = dask_worker.plugins[WORKER_PLUGIN].runtime.store
    return {"bytes": sum(store.size_of(h) for h in hashes if h in store)}


async def run_config(name: str, args: Options) -> dict:
    """One configuration over the seeded sessions: resume latency, recomputes, tiers, lifecycle decisions."""
    small = name != "resident"
    settings = {
        "kvstate.block-tokens": args.block_tokens,
        "kvstate.lifecycle.enabled": name == "lifecycle",
        "kvstate.scheduling.interval": "50ms",
    }
    rng = np.random.default_rng(args.seed)
    durations = rng.lognormal(np.log(args.tool_seconds), 0.3, size=(args.sessions, args.rounds))
    with dask.config.set(settings):
        async with (
            LocalCluster(
                n_workers=1, threads_per_worker=args.live + 1, processes=True, dashboard_address=":0", asynchronous=True
            ) as cluster,
            Client(cluster, asynchronous=True) as c,
        ):
            await c.run(lambda: None)
            budgets = {
                "device_bytes": args.device_bytes if small else 1 << 34,
                "host_bytes": 0 if small else 1 << 34,
                "disk_bytes": args.disk_bytes if small else 1 << 34,
            }
            await asyncio.to_thread(_install, cluster.scheduler_address, budgets)
            worker = next(iter(await c.run(os.getpid)))
            if not args.cold:  # steady state: the scheduler has seen the tester run once before
                with kvs.component("tester"):
                    await c.compute(
                        dask.delayed(run_tests)(args.tool_seconds, "warm-up", dask_key_name="run_tests-warm")
                    )
            resumes: list[dict] = []
            blocks_of: dict[str, set] = {}
            t0 = time.time()

            async def session(i: int) -> None:
                sid = new_session_id(f"dev{i}")
                seen = blocks_of.setdefault(sid, set())
                with dask.annotate(**{SESSION_ANNOTATION: sid}):
                    f = c.compute(kvs.materialize(conversation(i)))
                ref = await f
                del f
                seen.update(ref.blocks)
                for r in range(args.rounds):
                    report = f" Round {r}: test_{i}_{r} failed, the last field of record {r + 1} is missing."
                    with dask.annotate(**{SESSION_ANNOTATION: sid}):
                        with kvs.component("tester"):
                            tool = dask.delayed(run_tests)(
                                float(durations[i, r]), report, dask_key_name=f"run_tests-{sid}-{r}"
                            )
                        answer = kvs.resume(ref, tool, max_new_tokens=args.new_tokens)
                        nxt = kvs.extend(ref, tool, answer)
                        fa, fn = c.compute([answer, nxt])
                    submitted = time.time()
                    out, ref = await fa, await fn
                    del fa, fn  # the turn is over: only the ref's value is kept
                    seen.update(ref.blocks)
                    resumes.append(
                        {
                            "session": sid,
                            "round": r,
                            "ttft": out.ttft,
                            "submitted": submitted,
                            "finished": time.time(),
                            "reused": out.reused_tokens,
                        }
                    )
                await c.log_event(SESSION_TOPIC, {"kind": "close", "session": sid})  # what kvs.session's exit sends

            sem = asyncio.Semaphore(args.live)

            async def gated(i: int) -> None:
                async with sem:
                    await session(i)

            await asyncio.gather(*(gated(i) for i in range(args.sessions)))
            wall = time.time() - t0
            await asyncio.sleep(1.0)  # the last sessions end (one control interval) and are invalidated
            stats = (await c.run(_worker_stats))[worker]
            left = (await c.run(_store_blocks, set().union(*blocks_of.values())))[worker]["bytes"]
            events = [m for _, m in await c.get_events(LIFECYCLE_TOPIC)] if name == "lifecycle" else []
    # Resumes whose KV was brought back ahead of them by a prediction (not fetched late,
    # as their task ran: those are counted with the rest).
    predicted_at = {
        (e["session"], e["at"])
        for e in events
        if e["kind"] == "prefetch" and e.get("phase") == "decision" and e["why"] == "prediction"
    }
    prefetched = set()
    for r in resumes:
        if any(
            e["kind"] == "prefetch"
            and e.get("phase") == "done"
            and (e["session"], e["decision"]) in predicted_at
            and e["session"] == r["session"]
            and r["submitted"] <= e["decision"] <= r["finished"]
            for e in events
        ):
            prefetched.add((r["session"], r["round"]))
    ttft = sorted(x["ttft"] for x in resumes)
    pre = sorted(x["ttft"] for x in resumes if (x["session"], x["round"]) in prefetched)
    return {
        "config": name,
        "resumes": len(resumes),
        "wall_s": wall,
        "ttft_p50": statistics.median(ttft),
        "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
        "prefetched": len(pre),
        "prefetched_p50": statistics.median(pre) if pre else None,
        "recomputes": stats.get("recomputes", 0),
        "recompute_tokens": stats.get("recompute_tokens", 0),
        "peak_device_bytes": stats["tiers"]["device"]["peak_bytes"],
        "disk_hits": stats["tiers"]["disk"]["hits"],
        "ended_bytes_left": left,
        "offloads": sum(e["kind"] == "offload" and e.get("phase") == "decision" for e in events),
        "offloads_pressure": sum(e["kind"] == "offload" and e.get("why") == "pressure" for e in events),
        "prefetches": sum(e["kind"] == "prefetch" and e.get("phase") == "decision" for e in events),
    }


def _install(address: str, budgets: dict) -> None:
    with Client(address) as c:  # kvs.install wants a synchronous client
        kvs.install(c, "tiny-llama", torch_threads=1, **budgets)


def _worker_stats(dask_worker) -> dict:
    plugin = dask_worker.plugins[WORKER_PLUGIN]
    return plugin.runtime.stats()


def merge_runs(runs: list[dict]) -> dict:
    """One row per config: the median of each number over the repeats."""
    row = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            vals = [r[k] for r in runs if r[k] is not None]
            row[k] = statistics.median(vals) if vals else None
    row["runs"] = runs
    return row


def table(rows: list[dict]) -> str:
    base = next(r for r in rows if r["config"] == "resident")["ttft_p50"]
    fmt = lambda v: "-" if v is None else f"{v * 1e3:.1f}"
    lines = [
        (
            "| config | resumes | resume P50 ms | resume P90 ms | P50 vs resident | prefetched resumes | "
            "prefetched P50 ms | prefetched vs resident | recomputed blocks | recomputed tokens | "
            "peak device KiB | disk hits | offloads (pressure) | prefetches | ended sessions' KV left |"
        ),
        "|" + "---|" * 15,
    ]
    for r in rows:
        pv = f"{r['prefetched_p50'] / base:.2f}x" if r["prefetched_p50"] else "-"
        lines.append(
            f"| {r['config']} | {r['resumes']} | {fmt(r['ttft_p50'])} | {fmt(r['ttft_p90'])} | "
            f"{r['ttft_p50'] / base:.2f}x | {r['prefetched']:.0f} | {fmt(r['prefetched_p50'])} | {pv} | "
            f"{r['recomputes']:.0f} | {r['recompute_tokens']:.0f} | {r['peak_device_bytes'] / 1024:.0f} | "
            f"{r['disk_hits']:.0f} | {r['offloads']:.0f} ({r['offloads_pressure']:.0f}) | {r['prefetches']:.0f} | "
            f"{r['ended_bytes_left']:.0f} B |"
        )
    return "\n".join(lines)


def run(opts: Options) -> list[dict]:
    """Every config of ``opts.configs``, ``opts.repeats`` times interleaved; prints the table, writes ``opts.out``."""
    runs: dict[str, list] = {}
    for rep in range(opts.repeats):  # interleaved, so a noisy neighbour hits every config alike
        for name in opts.configs.split(","):
            runs.setdefault(name, []).append(
                asyncio.run(run_config(name, dataclasses.replace(opts, seed=opts.seed + rep)))
            )
    rows = [merge_runs(rs) for rs in runs.values()]
    text = table(rows)
    print(text)
    if opts.out:
        os.makedirs(opts.out, exist_ok=True)
        with open(os.path.join(opts.out, "lifecycle.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(opts.out, "lifecycle.json"), "w") as f:
            json.dump({"args": dataclasses.asdict(opts), "rows": rows}, f, indent=1)
    return rows
