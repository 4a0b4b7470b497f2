"""The home workload against the engine a user would run alone: k agents over one long context.

::

    python -m dask_kvstate.bench agents-vs-raw --out docs/bench/agents-vs-raw
    python -m dask_kvstate.bench agents-vs-raw --length 1024 --agents 8 --new-tokens 16   # shorter

``k`` agents share an ``L``-token context, each with its own question, each generating
``Y`` tokens; all ``k`` requests are known at once. Side by side, in one run, cold every
time (each round starts from empty prefix caches and stores), every output compared
token for token with the raw engine's:

- ``raw-vllm`` and ``raw-vllm-eager``: one ``vllm.LLM`` in its own process, every core,
  prefix caching on, all ``k`` prompts in one ``generate`` call
  (:mod:`dask_kvstate.bench.raw_vllm`), compiled (vLLM's default) and eager, and
  ``raw-vllm-core-in-process`` (vLLM's engine core in that process); the baseline is
  the fastest of those run (``--raw`` picks them);
- ``dask-path/<backend>``: the same requests as plain Dask tasks on one worker whose one
  engine has every core (a thread per request, so the engine batches them): what the
  Dask path alone costs against the raw engine, with nothing of kvstate's KV handling;
- ``kvstate/<backend>``: the code the README shows a user, as it is:
  ``LocalCluster(n_workers=2, threads_per_worker=1)``, ``kvs.install(client, model,
  backend=...)`` and the plain ``kvs.generate`` calls under ``kvs.stateflow()`` (the
  compiler and every default).

Rounds are interleaved (raw, raw eager, the Dask path, kvstate per backend, then again)
and every row runs alone: started, warmed up on another context (untimed), measured and
closed before the next starts. The table shows medians, and each row's prompt tokens
computed: the raw engine's are each prompt's tokens less those its prefix cache served
(whole blocks: each sibling prefills the context's last partial block again), kvstate's
the workers' ``prefill_tokens`` (the materialize's and every resume's), so the table says
how much of a lead is tokens not computed.
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
from dask.utils import parse_bytes
from distributed import Client, LocalCluster, get_task_stream

import dask_kvstate as kvs
from dask_kvstate.bench import workload
from dask_kvstate.bench.raw_vllm import DEFAULT_RAW, RAW, RawEngine, cpu_model
from dask_kvstate.bench.report import saved


@dataclasses.dataclass
class Options:
    """The experiment's settings; ``python -m dask_kvstate.bench agents-vs-raw`` has a flag for each."""

    model: str = dataclasses.field(default="smollm2-135m", metadata={"help": "model name or folder"})
    length: int = dataclasses.field(default=4096, metadata={"help": "tokens of the shared context"})
    agents: int = dataclasses.field(default=16, metadata={"help": "agents over the shared context"})
    new_tokens: int = dataclasses.field(default=64, metadata={"help": "tokens each agent generates"})
    engine_kv: str = dataclasses.field(
        default="2GiB", metadata={"help": "every engine's KV memory, raw and kvstate alike"}
    )
    backends: list[str] = dataclasses.field(
        default_factory=lambda: ["vllm", "hf"], metadata={"help": "kvstate's backends", "nargs": "+"}
    )
    dask_path: list[str] = dataclasses.field(
        default_factory=lambda: ["vllm"],
        metadata={"help": "backends of the Dask-path row (one worker, one engine, plain tasks)", "nargs": "*"},
    )
    raw: list[str] = dataclasses.field(
        default_factory=lambda: list(DEFAULT_RAW),
        metadata={"help": "raw engine variants", "nargs": "*", "choices": list(RAW)},
    )
    repeats: int = dataclasses.field(default=3, metadata={"help": "interleaved rounds; the table shows medians"})
    out: str | None = dataclasses.field(default=None, metadata={"help": "folder for agents_vs_raw.{md,json}"})


def small(**settings) -> Options:
    """The experiment at a size the asv suite affords: 8 agents over a 1,024-token context,
    16 new tokens, one round against the faster-starting raw engine (eager). The shared
    prefill kvstate saves is short there, so its ratios are near 1."""
    defaults = {"length": 1024, "agents": 8, "new_tokens": 16, "engine_kv": "512MiB", "repeats": 1}
    return Options(**{**defaults, "raw": ["raw-vllm-eager"], **settings})


def prompts(context: str, agents: int) -> list[tuple[str, str]]:
    return [(context, workload.suffix(i)) for i in range(agents)]


def run_raw(engine: RawEngine, parts: list[tuple[str, str]], new_tokens: int) -> dict:
    engine.reset_prefix_cache()
    results, wall = engine.generate([c + s for c, s in parts], new_tokens)
    computed = sum(r.prompt_tokens - r.cached_tokens for r in results)
    return {"wall_s": wall, "outputs": [r.token_ids for r in results], "computed_tokens": computed}


def run_kvstate(client, parts: list[tuple[str, str]], new_tokens: int, *, stateflow: bool = True) -> dict:
    """The README's code: plain ``kvs.generate`` calls, computed under ``kvs.stateflow()``.

    Without ``stateflow`` the same calls are plain Dask tasks, each sending its whole
    prompt to the worker's engine (whose own prefix cache serves what they share): the
    Dask path alone, with nothing of kvstate's KV handling.
    """
    workload.settle(client)
    before = workload.prefill_tokens(client)
    t0 = time.perf_counter()
    with get_task_stream(client) as stream, kvs.stateflow() if stateflow else contextlib.nullcontext():
        got = dask.compute(*[kvs.generate(c, s, max_new_tokens=new_tokens) for c, s in parts])
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "outputs": [list(g.token_ids) for g in got],
        "phases": phases(stream.data),
        "computed_tokens": workload.prefill_tokens(client) - before,
    }


def phases(tasks: list[dict]) -> dict[str, float]:
    """Where a round's time went: seconds from the first task's start to the last end of
    each kind of task (``kvs-materialize``, ``kvs-resume_many``, ...), from Dask's task stream."""
    spans: dict[str, list[float]] = {}
    for task in tasks:
        for ss in task["startstops"]:
            if ss["action"] == "compute":
                span = spans.setdefault(_kind(task["key"]), [ss["start"], ss["stop"]])
                span[0], span[1] = min(span[0], ss["start"]), max(span[1], ss["stop"])
    return {kind: stop - start for kind, (start, stop) in spans.items()}


def _kind(key) -> str:
    """``kvs-resume_many`` of ``("kvs-resume_many-<token>", 0)`` (Dask's ``key_split`` stops at the underscore)."""
    name = key[0] if isinstance(key, tuple) else str(key)
    head, _, token = name.rpartition("-")
    return head if head and len(token) >= 8 and all(c in "0123456789abcdef" for c in token) else name


def runnable(args: Options) -> tuple[list[str], dict[str, str]]:
    """The rows, in the order every round runs them, that can run the model, and the rows
    asked for whose backend refuses it with why (:func:`workload.runnable`)."""
    asked = {
        **dict.fromkeys(args.raw),
        **{f"dask-path/{b}": b for b in args.dask_path},
        **{f"kvstate/{b}": b for b in args.backends},
    }
    return workload.runnable(asked, args.model)


@contextlib.contextmanager
def started(name: str, args: Options) -> Iterator[tuple[float, Callable[[list[tuple[str, str]]], dict]]]:
    """Row ``name`` started, alone on the host: its start time and how to run a round on it.

    Every row runs with nothing else of the experiment resident (a raw engine and two
    clusters side by side slowed the raw engine's rounds by 30-45% on a 2-core VM), so
    each is started, warmed up with a round of another context (untimed), measured and
    closed, round after round.
    """
    kv = parse_bytes(args.engine_kv)
    t0 = time.perf_counter()
    if name in RAW:
        with RawEngine(args.model, kv_cache_bytes=kv, **RAW[name]) as engine:
            yield engine.start_s, lambda parts: run_raw(engine, parts, args.new_tokens)
        return
    kind, backend = name.split("/")
    dask_path = kind == "dask-path"
    # The Dask path: one worker holding one engine on every core, a thread per request so
    # the engine batches them all. kvstate: the README's cluster, as it is.
    n_workers, threads = (1, args.agents) if dask_path else (2, 1)
    cluster = LocalCluster(n_workers=n_workers, threads_per_worker=threads, dashboard_address=":0")
    try:
        with Client(cluster) as client:
            workload.install(client, args.model, {"kvstate.vllm.kv-cache-bytes": kv}, backend=backend)
            client.run(workload.warm_up)
            with client.as_current():
                yield (
                    time.perf_counter() - t0,
                    lambda parts: run_kvstate(client, parts, args.new_tokens, stateflow=not dask_path),
                )
    finally:
        cluster.close()


def command(args: Options) -> dict:
    """Every row ``args.repeats`` times, interleaved, each alone; the report to ``args.out``."""
    tokenize = workload.tokenizer_of(args.model)
    context = workload.context_text(workload.fit(workload.context_text, args.length, tokenize))
    print(f"agents-vs-raw: {args.agents} agents over a {len(tokenize(context))}-token context, Y = {args.new_tokens}")
    parts = prompts(context, args.agents)
    warm = prompts(workload.context_text(8), args.agents)  # no row times its warm-up
    names, skipped = runnable(args)
    for name, why in skipped.items():
        print(f"  {name} left out: {why}", flush=True)
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for name in names:
            with started(name, args) as (start_s, run):
                run(warm)
                runs.setdefault(name, []).append({**run(parts), "start_s": start_s})
            print(f"  round {rep}: {name} {runs[name][-1]['wall_s']:.2f} s (started in {start_s:.1f} s)", flush=True)
    res = report(runs, args)
    res["left_out"] = skipped
    res["context_tokens"] = len(tokenize(context))
    res["cpu"] = cpu_model()
    if args.out:
        write(res, Path(args.out))
    print(markdown(res))
    return res


def write(res: dict, out: Path) -> None:
    """``agents_vs_raw.{json,md,png}`` in ``out``: the png, each row's rounds and median beside the raw engine's."""
    plt = saved(res, out, "agents_vs_raw", markdown(res))
    if plt is None:
        return
    table = res["table"]
    names = list(table)
    right = max(w for n in names for w in table[n]["walls"]) * 1.02
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.barh(names, [table[n]["wall_s"] for n in names], color=["0.6" if n in RAW else "tab:blue" for n in names])
    for y, n in enumerate(names):
        ax.plot(table[n]["walls"], [y] * len(table[n]["walls"]), "k.", ms=5)
        ax.annotate(f"{table[n].get('speedup_vs_raw', 1):.2f}x", (right, y), va="center", fontsize=9)
    ax.set_xlim(0, right * 1.12)
    ax.invert_yaxis()
    o = res["options"]
    ax.set_xlabel("wall (s): bars the medians, dots the rounds; at the right: vs the faster raw engine")
    title = f"{o['agents']} agents over a {res.get('context_tokens', o['length'])}-token context ({res.get('cpu', '')})"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "agents_vs_raw.png", dpi=120)
    plt.close(fig)


def report(runs: dict[str, list[dict]], args: Options) -> dict:
    """Median wall per row, its ratio to the faster raw variant, and outputs equal to the raw engine's."""
    table: dict[str, dict[str, Any]] = {}
    ref = next((runs[n][0]["outputs"] for n in RAW if n in runs), None)
    for name, reps in runs.items():
        walls = [r["wall_s"] for r in reps]
        row: dict[str, Any] = {"wall_s": statistics.median(walls), "walls": walls}
        if all("computed_tokens" in r for r in reps):
            row["computed_tokens"] = statistics.median(r["computed_tokens"] for r in reps)
        kinds = {k for r in reps for k in r.get("phases", {})}
        if kinds:
            row["phases"] = {k: statistics.median(r["phases"].get(k, 0.0) for r in reps) for k in sorted(kinds)}
        if ref is not None:
            same = sum(g == w for r in reps for g, w in zip(r["outputs"], ref))
            row["identical"] = f"{same}/{len(ref) * len(reps)}"
        table[name] = row
    raw_walls = [table[n]["wall_s"] for n in RAW if n in table]
    if raw_walls:
        for row in table.values():
            row["speedup_vs_raw"] = min(raw_walls) / row["wall_s"]
    return {"options": dataclasses.asdict(args), "table": table, "runs": runs}


def markdown(res: dict) -> str:
    o = res["options"]
    lines = [
        f"# {o['agents']} agents over one context, against the raw engine ({res.get('cpu', '')})",
        "",
        f"{o['agents']} agents, a {res.get('context_tokens', o['length'])}-token shared context, "
        f"Y = {o['new_tokens']}, cold every round, medians of {o['repeats']} interleaved rounds.",
        "",
        "| row | wall (median) | rounds | vs the faster raw engine | outputs equal to raw vLLM's "
        "| prompt tokens computed |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in res["table"].items():
        rounds = ", ".join(f"{w:.2f}" for w in m["walls"])
        computed = f"{m['computed_tokens']:,.0f}" if "computed_tokens" in m else "-"
        lines.append(
            f"| {name} | {m['wall_s']:.2f} s | {rounds} | {m.get('speedup_vs_raw', 1):.2f}x | "
            f"{m.get('identical', '-')} | {computed} |"
        )
    spans = [
        f"{name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in m["phases"].items())
        for name, m in res["table"].items()
        if m.get("phases")
    ]
    if spans:
        lines += ["", "Where the rows' time went (first start to last end of each kind of task, medians):", ""]
        lines += [f"- {line}" for line in spans]
    return "\n".join(lines + workload.left_out_lines(res.get("left_out", {}))) + "\n"
