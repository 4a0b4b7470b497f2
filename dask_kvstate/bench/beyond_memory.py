"""KV beyond the engine's memory: sessions that come back after the engine forgot them.

::

    python -m dask_kvstate.bench beyond-memory --out docs/bench/beyond-memory
    python -m dask_kvstate.bench beyond-memory --sessions 6 --doc-tokens 1500 --rounds 2   # shorter

``S`` sessions, each with its own long document (a RAG corpus chunk, a codebase, a
conversation), are visited round-robin for ``R`` rounds, one request at a time: visit
``r`` of session ``s`` asks a new question about document ``s``. The engine's KV memory
(``--engine-kv``) is below the documents' total, so an engine alone has evicted a
document (LRU) by the time its session returns and prefills it again.

Side by side, in one run, each row alone on the host (started, warmed up on a spare
document, measured, closed; repeats interleaved), every output compared token for token
with the raw engine's:

- ``raw-vllm``: one ``vllm.LLM`` in its own process, every core, prefix caching on,
  the same KV memory (:mod:`dask_kvstate.bench.raw_vllm`), each request submitted as it
  arrives;
- ``kvstate``: one Dask worker whose vLLM engine has the same KV memory, the plain
  calls a user writes, ``kvs.generate(document, question, prefix_cache=True)``: the
  first visit's own request leaves its prompt's KV in the worker's block store, a
  returning visit loads it back into the engine;
- ``kvstate-disk``: the same with the store's memory tiers (``--memory-tier``) below the
  documents' total, so states spill to the disk tier and returning visits read them
  back from there;
- ``kvstate-lifecycle``: the disk row's budgets, with the visits given as the workflow
  they are: one graph, each visit a task of its session (``kvstate-session``) that
  starts when the visit before it has finished. The KV lifecycle (on by default) sees
  each session's next visit coming by workflow progress, moves the session's state out
  after its visit and back up before its next one, so a returning visit reads memory,
  not disk;
- with ``--backends vllm hf``, the same two kvstate rows over transformers.

Reported per row: first-visit and returning-visit TTFT (median), their ratio to the
raw engine's, end-to-end latency as the client sees it, and the store tiers each
returning visit read its blocks from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dask
from dask.utils import format_bytes, parse_bytes
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.bench import workload
from dask_kvstate.bench.kv_reads import PredictedPrefetches, TierReads
from dask_kvstate.bench.raw_vllm import DEFAULT_RAW, RAW, RawEngine, cpu_model
from dask_kvstate.bench.report import saved
from dask_kvstate.protocol import LIFECYCLE_TOPIC, SESSION_ANNOTATION

KVSTATE_ROWS = ("kvstate", "kvstate-disk", "kvstate-lifecycle")
VARIANTS = (*RAW, *KVSTATE_ROWS)
DEFAULT_VARIANTS = (*DEFAULT_RAW, *KVSTATE_ROWS)


@dataclasses.dataclass
class Options:
    """The experiment's settings; ``python -m dask_kvstate.bench beyond-memory`` has a flag for each."""

    model: str = dataclasses.field(default="smollm2-135m", metadata={"help": "model name or folder"})
    sessions: int = dataclasses.field(default=12, metadata={"help": "sessions, each with its own document"})
    doc_tokens: int = dataclasses.field(default=3000, metadata={"help": "tokens of each session's document"})
    rounds: int = dataclasses.field(default=3, metadata={"help": "visits of each session, round-robin"})
    new_tokens: int = dataclasses.field(default=16, metadata={"help": "tokens each visit generates"})
    engine_kv: str = dataclasses.field(
        default="1GiB", metadata={"help": "the engines' KV memory (raw and kvstate alike), below the documents' total"}
    )
    max_model_len: int | None = dataclasses.field(
        default=None, metadata={"help": "the engines' longest request (tokens); default: the model's own"}
    )
    memory_tier: str = dataclasses.field(
        default="384MiB",
        metadata={"help": "kvstate-disk and kvstate-lifecycle: the store's device and host tier budgets, each"},
    )
    backends: list[str] = dataclasses.field(
        default_factory=lambda: ["vllm"], metadata={"help": "kvstate's backends: vllm and/or hf", "nargs": "+"}
    )
    variants: list[str] = dataclasses.field(
        default_factory=lambda: list(DEFAULT_VARIANTS),
        metadata={"help": "rows to run", "nargs": "+", "choices": VARIANTS},
    )
    repeats: int = dataclasses.field(default=1, metadata={"help": "interleaved repeats; the table shows medians"})
    out: str | None = dataclasses.field(default=None, metadata={"help": "folder for beyond_memory.{md,json,png}"})


def small(**settings) -> Options:
    """The experiment at the smallest size that still shows the regime (three ~600-token
    documents, an engine holding about two of them, store memory tiers of one block):
    what the test and the asv suite run."""
    base: dict[str, Any] = {
        "sessions": 3,
        "doc_tokens": 600,
        "rounds": 2,
        "new_tokens": 4,
        "engine_kv": "60MiB",
        "max_model_len": 1024,
        "memory_tier": "4MiB",
    }
    return Options(**{**base, **settings})


# -- the workload ---------------------------------------------------------------------
def document(s: int, lines: int) -> str:
    """Session ``s``'s document: its own header first, so no two sessions share a block."""
    body = "".join(workload.log_line(i + 7919 * s) for i in range(lines))
    return (
        f"<|im_start|>system\nSession {s}. {workload.SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\nIncident report INC-{3100 + s}, log lines:\n{body}"
    )


def question(s: int, r: int) -> str:
    q = workload.QUESTIONS[(s + 3 * r) % len(workload.QUESTIONS)]
    return f"\nVisit {r + 1}. {q} Answer in one short sentence.<|im_end|>\n<|im_start|>assistant\n"


def documents(model: str, sessions: int, tokens: int) -> list[str]:
    """One document of at most ``tokens`` tokens per session (counted with the model's tokenizer)."""
    tokenize = workload.tokenizer_of(model)
    return [document(s, workload.fit(lambda n, s=s: document(s, n), tokens, tokenize)) for s in range(sessions)]


def visits(sessions: int, rounds: int) -> list[tuple[int, int]]:
    """``(session, round)`` in arrival order: every session once per round, round after round."""
    return [(s, r) for r in range(rounds) for s in range(sessions)]


# -- the rows -------------------------------------------------------------------------
def run_raw(engine: RawEngine, docs: list[str], order: list[tuple[int, int]], new_tokens: int) -> list[dict]:
    """The visits on the raw engine, each submitted once the last one finished, from a cold prefix cache."""
    engine.reset_prefix_cache()
    prompts = [docs[s] + question(s, r) for s, r in order]
    return [
        {
            "session": s,
            "round": r,
            "ttft_s": x.ttft_s,
            "latency_s": x.latency_s,
            "token_ids": x.token_ids,
            "reused_tokens": x.cached_tokens,  # what vLLM's own prefix cache still held of the prompt
        }
        for (s, r), x in zip(order, engine.one_by_one(prompts, new_tokens))
    ]


def _tier_hits(client) -> dict[str, int]:
    """Blocks each store tier has served so far, summed over the workers."""
    hits = {"device": 0, "host": 0, "disk": 0}
    for s in kvs.stats(client).workers.values():
        for tier in hits:
            hits[tier] += s["tiers"][tier]["hits"]
    return hits


def run_kvstate(client, docs: list[str], order: list[tuple[int, int]], new_tokens: int) -> list[dict]:
    """The visits as a user writes them: one ``kvs.generate`` per request, computed as it
    arrives, from empty stores and engine caches."""
    workload.settle(client)
    rows = []
    for s, r in order:
        before = _tier_hits(client)
        t0 = time.perf_counter()
        g = _visit(docs[s], question(s, r), new_tokens).compute()
        latency = time.perf_counter() - t0
        after = _tier_hits(client)
        rows.append(
            {
                "session": s,
                "round": r,
                "ttft_s": g.ttft,
                "latency_s": latency,
                "token_ids": list(g.token_ids),
                "reused_tokens": g.reused_tokens,
                "tiers": {t: after[t] - before[t] for t in after if after[t] > before[t]},
            }
        )
    return rows


def _visit(doc: str, q, new_tokens: int):
    return kvs.generate(doc, q, max_new_tokens=new_tokens, prefix_cache=True)


def _arrives(previous, q: str) -> str:
    """The workflow's order: visit ``k``'s question arrives once visit ``k - 1`` has answered."""
    return q


def run_workflow(client, docs: list[str], order: list[tuple[int, int]], new_tokens: int) -> list[dict]:
    """The visits as one workflow of sessions (the ``kvstate-lifecycle`` row): submitted at
    once, each starting when the one before it has finished, each session's tasks
    annotated with its session, so the lifecycle predicts every session's next visit.

    A first visit (reading a new document) and a follow-up are different steps of the
    workflow, and take very different times: each is its own component
    (``kvs.component``), so the lifecycle's duration history predicts each from its own.
    """
    workload.settle(client)
    client.run(lambda dask_worker: dask_worker.plugins[TierReads.name].visits.clear())
    with contextlib.ExitStack() as stack:
        sessions = {s: stack.enter_context(kvs.session(f"doc{s}", client=client)).id for s in dict(order)}
        visits, previous = [], None
        for s, r in order:
            with dask.annotate(**{SESSION_ANNOTATION: sessions[s]}):
                q = question(s, r)
                if previous is not None:
                    q = dask.delayed(_arrives, pure=True)(previous, q, dask_key_name=f"arrives-{s}-{r}")
                with kvs.component("ask" if r else "read"):
                    previous = _visit(docs[s], q, new_tokens)
            visits.append(previous)
        results = client.compute(visits, sync=True)
    reads = next(iter(client.run(lambda dask_worker: dask_worker.plugins[TierReads.name].visits).values()))
    prefetched = PredictedPrefetches(client.get_events(LIFECYCLE_TOPIC))
    rows: list[dict] = []
    last_visit: dict[int, float] = {}
    for (s, r), v, g in zip(order, visits, results):
        seen = reads.get(v.key, {"at": float("nan"), "seconds": float("nan"), "tiers": {}})
        since = last_visit.get(s, 0.0)
        last_visit[s] = seen["at"]
        rows.append(
            {
                "session": s,
                "round": r,
                "ttft_s": g.ttft,
                "latency_s": seen["seconds"],  # the visit's task alone: no client round trip in a workflow
                "token_ids": list(g.token_ids),
                "reused_tokens": g.reused_tokens,
                "tiers": seen["tiers"],
                # blocks the lifecycle brought up for this session, decided by a prediction,
                # between its previous visit and this one's start
                "prefetched_blocks": prefetched.blocks(sessions[s], since, seen["at"]),
            }
        )
    return rows


def _cluster(backend: str, args: Options, disk: bool):
    settings = {
        "kvstate.backend": backend,
        "kvstate.vllm.kv-cache-bytes": parse_bytes(args.engine_kv),
        "kvstate.vllm.max-model-len": args.max_model_len,
    }
    tier = parse_bytes(args.memory_tier) if disk else None  # None: the store's own budgets
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0")
    client = Client(cluster)
    workload.install(client, args.model, settings, device_bytes=tier, host_bytes=tier)
    client.register_plugin(TierReads())
    client.run(workload.warm_up)
    return cluster, client


def summarize(rows: list[dict]) -> dict[str, Any]:
    first = [x for x in rows if x["round"] == 0]
    back = [x for x in rows if x["round"] > 0]
    tiers: dict[str, int] = {}
    for x in back:
        for t, n in x.get("tiers", {}).items():
            tiers[t] = tiers.get(t, 0) + n
    return {
        "first_ttft_s": statistics.median(x["ttft_s"] for x in first),
        "returning_ttft_s": statistics.median(x["ttft_s"] for x in back) if back else None,
        "first_latency_s": statistics.median(x["latency_s"] for x in first),
        "returning_latency_s": statistics.median(x["latency_s"] for x in back) if back else None,
        "returning_tier_blocks": tiers,
    }


def runnable(args: Options) -> tuple[list[str], dict[str, str]]:
    """The rows, in the order every repeat runs them, that can run the model, and the rows
    asked for whose backend refuses it with why (:func:`workload.runnable`)."""
    asked: dict[str, str | None] = {name: None for name in RAW if name in args.variants}
    for backend in args.backends:
        asked |= {f"{v}/{backend}": backend for v in args.variants if v.startswith("kvstate")}
    return workload.runnable(asked, args.model)


@contextlib.contextmanager
def started(name: str, args: Options, spare: str) -> Iterator[Callable[[list[str], list[tuple[int, int]]], list[dict]]]:
    """Row ``name`` started alone on the host and warmed up on the ``spare`` document
    (untimed, so no row times its kernels', allocator's or compiled graphs' first use):
    how to run the visits on it. Closed on leaving, before the next row starts (rows
    resident side by side slowed each other's rounds, ``agents_vs_raw.started``)."""
    if name in RAW:
        with RawEngine(
            args.model,
            kv_cache_bytes=parse_bytes(args.engine_kv),
            max_model_len=args.max_model_len,
            **RAW[name],
        ) as engine:
            engine.one_by_one([spare + question(0, 0)], args.new_tokens)
            print(f"  {name}: engine started in {engine.start_s:.1f} s", flush=True)
            yield lambda docs, order: run_raw(engine, docs, order, args.new_tokens)
        return
    variant, backend = name.split("/")
    cluster, client = _cluster(backend, args, disk=variant != "kvstate")
    run = run_workflow if variant == "kvstate-lifecycle" else run_kvstate
    try:
        with client.as_current():
            _visit(spare, question(0, 0), args.new_tokens).compute()
            yield lambda docs, order: run(client, docs, order, args.new_tokens)
    finally:
        client.close()
        cluster.close()


def command(args: Options) -> dict:
    """Run every row ``args.repeats`` times, interleaved, each alone; write the report to ``args.out``."""
    docs = documents(args.model, args.sessions + 1, args.doc_tokens)
    spare, docs = docs[-1], docs[:-1]
    order = visits(args.sessions, args.rounds)
    print(
        f"beyond-memory: {args.sessions} sessions x {args.rounds} rounds, documents of <= {args.doc_tokens} tokens, "
        f"engine KV {format_bytes(parse_bytes(args.engine_kv))}",
        flush=True,
    )
    names, skipped = runnable(args)
    for name, why in skipped.items():
        print(f"  {name} left out: {why}", flush=True)
    rows: dict[str, list[list[dict]]] = {}
    for rep in range(args.repeats):
        for name in names:
            with started(name, args, spare) as run:
                rows.setdefault(name, []).append(run(docs, order))
            print(f"  repeat {rep}: {name} {summarize(rows[name][-1])}", flush=True)
    res = report(rows, args)
    res["left_out"] = skipped
    res["cpu"] = cpu_model()
    if args.out:
        write(res, Path(args.out))
    return res


def report(rows: dict[str, list[list[dict]]], args: Options) -> dict:
    """Each row's figures as the median over repeats; ratios against the raw engine (the
    faster raw variant for each figure); how many of each row's outputs equal the raw
    engine's (its first repeat) token for token."""
    table: dict[str, dict[str, Any]] = {}
    for name, reps in rows.items():
        sums = [summarize(r) for r in reps]
        table[name] = {
            k: v if isinstance(v, dict) or v is None else statistics.median(s[k] for s in sums)
            for k, v in sums[0].items()
        }
    identical: dict[str, str] = {}
    raw_names = [n for n in RAW if n in table]
    if raw_names:
        best = {k: min(table[n][k] for n in raw_names) for k in ("first_ttft_s", "returning_ttft_s")}
        ref = rows[raw_names[0]][0]
        for name, reps in rows.items():
            same = sum(a["token_ids"] == b["token_ids"] for rep in reps for a, b in zip(rep, ref))
            identical[name] = f"{same}/{len(ref) * len(reps)}"
            m = table[name]
            m["first_vs_raw"] = m["first_ttft_s"] / best["first_ttft_s"]
            if m["returning_ttft_s"] and best["returning_ttft_s"]:
                m["returning_speedup"] = best["returning_ttft_s"] / m["returning_ttft_s"]
    return {"options": dataclasses.asdict(args), "table": table, "identical": identical, "rows": rows}


def markdown(res: dict) -> str:
    o = res["options"]
    lines = [
        f"# KV beyond the engine's memory ({res.get('cpu', '')})",
        "",
        f"{o['sessions']} sessions x {o['rounds']} rounds, documents of <= {o['doc_tokens']} tokens, "
        f"{o['new_tokens']} new tokens, engine KV {o['engine_kv']}, medians of {o['repeats']} interleaved repeat(s).",
        "",
        "| row | first visit TTFT | vs raw | returning TTFT | raw / row | returning latency "
        "| tiers read (returning) | identical to raw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in res["table"].items():
        tiers = ", ".join(f"{t} {n}" for t, n in m["returning_tier_blocks"].items()) or "-"
        lines.append(
            f"| {name} | {m['first_ttft_s']:.3f} s | {m.get('first_vs_raw', 1):.2f}x | "
            f"{(m['returning_ttft_s'] or 0):.3f} s | {m.get('returning_speedup', 1):.1f}x | "
            f"{(m['returning_latency_s'] or 0):.3f} s | {tiers} | {res['identical'].get(name, '-')} |"
        )
    return "\n".join(lines + workload.left_out_lines(res.get("left_out", {}))) + "\n"


def write(res: dict, out: Path) -> None:
    plt = saved(res, out, "beyond_memory", markdown(res))
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, reps in res["rows"].items():
        ax.plot([x["ttft_s"] for x in reps[0]], marker="o", ms=3, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("visit (round-robin over the sessions)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("KV beyond the engine's memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "beyond_memory.png", dpi=120)
    plt.close(fig)
