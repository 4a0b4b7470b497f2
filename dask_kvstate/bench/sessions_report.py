"""The report of :mod:`dask_kvstate.bench.sessions_vs_raw`: each row's session latencies
and engine steps as medians over repeats, the ratios to the best raw row, the answers
compared with the raw engine's, and the table and plot written from them."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dask_kvstate.bench.raw_vllm import RAW, raw_variant
from dask_kvstate.bench.report import saved

if TYPE_CHECKING:
    from dask_kvstate.bench.sessions_vs_raw import Options


def summarize(result: list[dict], steps: dict | None = None) -> dict[str, float]:
    """End-to-end session latency (arrival to last answer): mean, P50, P99, and the makespan;
    prompt tokens the engine computed (not served from a cache or a state); given the run's
    engine ``steps``, how many it took, the seconds inside them and of those the seconds
    copying KV in and out (none in the raw engine)."""
    e2e = np.array([s["end_s"] - s["arrival_s"] for s in result])
    computed = sum(c["computed_tokens"] for s in result for c in s["calls"])
    out = {
        "mean_s": float(e2e.mean()),
        "p50_s": float(np.percentile(e2e, 50)),
        "p99_s": float(np.percentile(e2e, 99)),
        "makespan_s": max(s["end_s"] for s in result),
        "computed_tokens": computed,
    }
    if steps is not None:
        out.update(
            engine_steps=steps["steps"],
            engine_busy_s=steps["step_s"],
            engine_copy_s=steps.get("load_s", 0.0) + steps.get("capture_s", 0.0),
        )
    return out


def report(runs: dict[str, list[list[dict]]], args: Options, steps: dict[str, list[dict]] | None = None) -> dict:
    """Each row's figures, medians over repeats; the mean's speedup and the P99's change
    against the better raw variant; answers equal to the raw engine's (its first repeat);
    given ``steps``, each row's engine steps and the seconds inside them."""
    table: dict[str, dict[str, Any]] = {}
    for name, reps in runs.items():
        measured = (steps or {}).get(name)
        engine: list[dict | None] = list(measured) if measured else [None] * len(reps)
        sums = [summarize(r, e) for r, e in zip(reps, engine)]
        table[name] = {k: statistics.median(s[k] for s in sums) for k in sums[0]}
    raw_names = [n for n in table if raw_variant(n)]
    if raw_names:
        best_mean = min(table[n]["mean_s"] for n in raw_names)
        best_p99 = min(table[n]["p99_s"] for n in raw_names)
        ref = [c["token_ids"] for s in runs[raw_names[0]][0] for c in s["calls"]]
        for name, reps in runs.items():
            row = table[name]
            row["mean_speedup"] = best_mean / row["mean_s"]
            row["p99_change"] = row["p99_s"] / best_p99 - 1
            same = sum(
                got == want for rep in reps for got, want in zip((c["token_ids"] for s in rep for c in s["calls"]), ref)
            )
            row["identical"] = f"{same}/{len(ref) * len(reps)}"
    return {"options": dataclasses.asdict(args), "table": table, "runs": runs, "steps": steps or {}}


def markdown(res: dict) -> str:
    o = res["options"]
    lines = [
        f"# {o['sessions']} multi-round sessions against the raw engine ({res.get('cpu', '')})",
        "",
        f"{o['sessions']} sessions of {o['rounds']} rounds (planner, developer, tester each round) on a growing "
        f"context from a <= {o['doc_tokens']}-token ticket, <= {o['new_tokens']} new tokens a call, arrivals "
        f"{o['rate']}/s (Poisson, seed {o['seed']}), engine KV {o['engine_kv']}"
        + (f" (raw rows also with {', '.join(o['raw_engine_kv'])})" if o.get("raw_engine_kv") else "")
        + f", kvstate worker threads "
        f"{o['threads']}, raw engine max_num_seqs {o.get('raw_max_seqs') or 'vLLM default'}; "
        f"medians of {o['repeats']} interleaved repeat(s).",
        "",
        "| row | mean E2E | vs raw (mean) | P50 | P99 | P99 vs raw | makespan | prompt tokens computed "
        "| engine steps | seconds in them | of which copying KV | answers equal to raw vLLM's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in res["table"].items():
        steps = (
            f"{m['engine_steps']:,.0f} | {m['engine_busy_s']:.1f} s | {m.get('engine_copy_s', 0):.1f} s"
            if "engine_steps" in m
            else "- | - | -"
        )
        lines.append(
            f"| {name} | {m['mean_s']:.2f} s | {m.get('mean_speedup', 1):.2f}x | {m['p50_s']:.2f} s | "
            f"{m['p99_s']:.2f} s | {100 * m.get('p99_change', 0):+.0f}% | {m['makespan_s']:.1f} s | "
            f"{m['computed_tokens']:,.0f} | {steps} | {m.get('identical', '-')} |"
        )
    return "\n".join(lines) + "\n"


def write(res: dict, out: Path) -> None:
    """``sessions_vs_raw.{json,md,png}`` in ``out``; the png: each row's session latencies, sorted."""
    plt = saved(res, out, "sessions_vs_raw", markdown(res))
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, reps in res["runs"].items():
        e2e = sorted(s["end_s"] - s["arrival_s"] for s in reps[0])
        raw: dict[str, str] = {}
        variant_name = raw_variant(name)
        if variant_name:  # raw rows grey, lighter with more memory: eager dashed, core in process dotted
            variant = RAW[variant_name]
            style = "--" if variant.get("enforce_eager") else ":" if variant.get("core_in_process") else "-"
            raw = {"color": "0.5" if name == variant_name else "0.75", "linestyle": style}
        ax.plot(np.arange(1, len(e2e) + 1) / len(e2e), e2e, label=name, **raw)
    ax.set_xlabel("fraction of sessions done within (first repeat)")
    ax.set_ylabel("end-to-end session latency (s)")
    ax.set_title(f"{res['options']['sessions']} multi-round sessions ({res.get('cpu', '')})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sessions_vs_raw.png", dpi=120)
    plt.close(fig)
