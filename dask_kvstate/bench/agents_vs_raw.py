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
  (:mod:`dask_kvstate.bench.raw_vllm`), compiled (vLLM's default) and eager; the
  baseline is the faster of the two;
- ``kvstate/<backend>``: the code the README shows a user, as it is:
  ``LocalCluster(n_workers=2, threads_per_worker=1)``, ``kvs.install(client, model,
  backend=...)`` and the plain ``kvs.generate`` calls under ``kvs.stateflow()`` (the
  compiler and every default).

Rounds are interleaved (raw, raw eager, kvstate per backend, then again); the table
shows medians.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import dask
from dask.utils import parse_bytes
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.bench import workload
from dask_kvstate.bench.raw_vllm import RAW, RawEngine, cpu_model


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
    raw: list[str] = dataclasses.field(
        default_factory=lambda: list(RAW), metadata={"help": "raw engine variants", "nargs": "*", "choices": list(RAW)}
    )
    repeats: int = dataclasses.field(default=3, metadata={"help": "interleaved rounds; the table shows medians"})
    out: str | None = dataclasses.field(default=None, metadata={"help": "folder for agents_vs_raw.{md,json}"})


def prompts(context: str, agents: int) -> list[tuple[str, str]]:
    return [(context, workload.suffix(i)) for i in range(agents)]


def run_raw(engine: RawEngine, parts: list[tuple[str, str]], new_tokens: int) -> dict:
    engine.reset_prefix_cache()
    results, wall = engine.generate([c + s for c, s in parts], new_tokens)
    return {"wall_s": wall, "outputs": [r.token_ids for r in results]}


def run_kvstate(client, parts: list[tuple[str, str]], new_tokens: int) -> dict:
    """The README's code: plain ``kvs.generate`` calls, computed under ``kvs.stateflow()``."""
    workload.settle(client)
    t0 = time.perf_counter()
    with kvs.stateflow():
        got = dask.compute(*[kvs.generate(c, s, max_new_tokens=new_tokens) for c, s in parts])
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "outputs": [list(g.token_ids) for g in got]}


def _cluster(model: str, backend: str, engine_kv: str):
    with dask.config.set({"kvstate.vllm.kv-cache-bytes": parse_bytes(engine_kv)}):  # read by the workers' engines
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0")
    client = Client(cluster)
    kvs.install(client, model, backend=backend)
    client.run(workload.warm_up)
    return cluster, client


def command(args: Options) -> dict:
    """Every row ``args.repeats`` times, interleaved; the report to ``args.out``."""
    tokenize = workload.tokenizer_of(args.model)
    context = workload.context_text(workload.fit(workload.context_text, args.length, tokenize))
    print(f"agents-vs-raw: {args.agents} agents over a {len(tokenize(context))}-token context, Y = {args.new_tokens}")
    parts = prompts(context, args.agents)
    # A round of another context first on every engine, untimed: no row times its warm-up.
    warm = prompts(workload.context_text(8), args.agents)
    runs: dict[str, list[dict]] = {}
    raws: dict[str, RawEngine] = {}
    clusters: dict[str, tuple] = {}
    try:
        for name in args.raw:
            raws[name] = RawEngine(args.model, kv_cache_bytes=parse_bytes(args.engine_kv), enforce_eager=RAW[name])
            run_raw(raws[name], warm, args.new_tokens)
            print(f"  {name}: engine started in {raws[name].start_s:.1f} s", flush=True)
        for backend in args.backends:
            clusters[f"kvstate/{backend}"] = cluster, client = _cluster(args.model, backend, args.engine_kv)
            with client.as_current():
                run_kvstate(client, warm, args.new_tokens)
        for rep in range(args.repeats):
            for name, engine in raws.items():
                runs.setdefault(name, []).append(run_raw(engine, parts, args.new_tokens))
                print(f"  round {rep}: {name} {runs[name][-1]['wall_s']:.2f} s", flush=True)
            for name, (_, client) in clusters.items():
                with client.as_current():
                    runs.setdefault(name, []).append(run_kvstate(client, parts, args.new_tokens))
                print(f"  round {rep}: {name} {runs[name][-1]['wall_s']:.2f} s", flush=True)
    finally:
        for engine in raws.values():
            engine.close()
        for cluster, client in clusters.values():
            client.close()
            cluster.close()
    res = report(runs, args)
    res["context_tokens"] = len(tokenize(context))
    res["cpu"] = cpu_model()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "agents_vs_raw.json").write_text(json.dumps(res, indent=1))
        (out / "agents_vs_raw.md").write_text(markdown(res))
    print(markdown(res))
    return res


def report(runs: dict[str, list[dict]], args: Options) -> dict:
    """Median wall per row, its ratio to the faster raw variant, and outputs equal to the raw engine's."""
    table: dict[str, dict[str, Any]] = {}
    ref = next((runs[n][0]["outputs"] for n in RAW if n in runs), None)
    for name, reps in runs.items():
        walls = [r["wall_s"] for r in reps]
        row: dict[str, Any] = {"wall_s": statistics.median(walls), "walls": walls}
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
        "| row | wall (median) | rounds | vs the faster raw engine | outputs equal to raw vLLM's |",
        "|---|---|---|---|---|",
    ]
    for name, m in res["table"].items():
        rounds = ", ".join(f"{w:.2f}" for w in m["walls"])
        lines.append(
            f"| {name} | {m['wall_s']:.2f} s | {rounds} | {m.get('speedup_vs_raw', 1):.2f}x | "
            f"{m.get('identical', '-')} |"
        )
    return "\n".join(lines) + "\n"
