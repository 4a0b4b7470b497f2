"""Every raw-engine comparison in one run, each kvstate row beside the raw engine's, and the bars.

::

    python -m dask_kvstate.bench vs-raw --out docs/bench/vs-raw        # ~1 hour on 2 cores
    python -m dask_kvstate.bench vs-raw --parts agents-vs-raw          # some of them
    python -m dask_kvstate.bench vs-raw --small                        # each at its small() size

Runs, one after the other, the three experiments that measure kvstate against the engine a
user would run alone (one ``vllm.LLM`` in its own process, every core, prefix caching on;
:mod:`dask_kvstate.bench.raw_vllm`), each at the settings of its published run:

- ``agents-vs-raw`` (:mod:`~dask_kvstate.bench.agents_vs_raw`): 16 agents over one
  4,096-token context, all known at once; the README's code on each backend, and the Dask
  path alone (the same requests as plain tasks into one worker's engine);
- ``beyond-memory`` (:mod:`~dask_kvstate.bench.beyond_memory`): eight sessions with their
  own ~3,000-token documents visited round-robin, engine KV memory (512 MiB) below the
  documents' total, states in the store's memory tiers, on its disk tier, and on disk
  fetched back by the lifecycle ahead of each visit, over vLLM and over transformers;
- ``sessions-vs-raw`` (:mod:`~dask_kvstate.bench.sessions_vs_raw`): 32 multi-round
  SWE-loop sessions at once, the raw engine also with more KV memory.

Each experiment writes its own report and plot (``<out>/<experiment>/``); this one then
prints and writes (``<out>/vs_raw.{md,json,png}``) one table: every kvstate row's figure
beside the better raw variant's, its ratio, the bar it is held to and whether it meets it,
and how many of its outputs equal the raw engine's token for token. For other settings,
run the experiments one by one.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from pathlib import Path
from typing import Any

from dask_kvstate.bench import workload
from dask_kvstate.bench.raw_vllm import cpu_model, raw_variant
from dask_kvstate.bench.report import saved

#: experiment -> (its module, the settings of its published run, over its defaults)
PARTS: dict[str, tuple[str, dict[str, Any]]] = {
    "agents-vs-raw": ("dask_kvstate.bench.agents_vs_raw", {}),
    "beyond-memory": (
        "dask_kvstate.bench.beyond_memory",
        {"sessions": 8, "engine_kv": "512MiB", "backends": ["vllm", "hf"]},
    ),
    "sessions-vs-raw": ("dask_kvstate.bench.sessions_vs_raw", {}),
}


@dataclasses.dataclass(frozen=True)
class Bar:
    """What a kvstate row is held to against the raw engine: ``raw / row`` of one figure
    (a time: higher is better) at least ``at_least``. ``target`` says it in the issue's words."""

    measure: str
    key: str  # the figure, in the experiment's table
    at_least: float
    target: str


#: the bars, per experiment and kind of row (the row's name up to its "/")
BARS: dict[str, dict[str, list[Bar]]] = {
    "agents-vs-raw": {
        "kvstate": [Bar("wall, agents over one context", "wall_s", 1.2, ">= 1.2x")],
        "dask-path": [Bar("wall, the Dask path alone", "wall_s", 0.97, ">= 0.97x")],
    },
    "beyond-memory": {
        "kvstate": [
            Bar("returning visit TTFT", "returning_ttft_s", 10.0, ">= 10x"),
            Bar("first visit TTFT", "first_ttft_s", 1 / 1.10, "<= 1.10x raw's"),
        ],
        "kvstate-disk": [
            Bar("returning visit TTFT, states on disk", "returning_ttft_s", 5.0, ">= 5x"),
            Bar("first visit TTFT, states on disk", "first_ttft_s", 1 / 1.10, "<= 1.10x raw's"),
        ],
        "kvstate-lifecycle": [
            Bar("returning visit TTFT, states on disk, prefetched", "returning_ttft_s", 5.0, ">= 5x"),
            Bar("first visit TTFT, states on disk, prefetched", "first_ttft_s", 1 / 1.10, "<= 1.10x raw's"),
        ],
    },
    "sessions-vs-raw": {
        "kvstate": [
            Bar("mean session latency", "mean_s", 1.3, ">= 1.3x"),
            Bar("P99 session latency", "p99_s", 1 / 0.7, "-30% or less"),
        ],
    },
}


@dataclasses.dataclass
class Options:
    """The run's settings; ``python -m dask_kvstate.bench vs-raw`` has a flag for each."""

    model: str = dataclasses.field(default="smollm2-135m", metadata={"help": "model name or folder"})
    parts: list[str] = dataclasses.field(
        default_factory=lambda: list(PARTS),
        metadata={"help": "the experiments to run", "nargs": "+", "choices": list(PARTS)},
    )
    small: bool = dataclasses.field(
        default=False, metadata={"help": "each experiment at its small() size (minutes, not an hour)"}
    )
    out: str | None = dataclasses.field(
        default=None, metadata={"help": "folder for vs_raw.{md,json,png} and each experiment's own report"}
    )


def settings(part: str, args: Options) -> Any:
    """The ``Options`` of experiment ``part`` in this run."""
    name, published = PARTS[part]
    module = importlib.import_module(name)
    out = str(Path(args.out) / part) if args.out else None
    if args.small:
        return module.small(model=args.model, out=out)
    return module.Options(**{**published, "model": args.model, "out": out})


def command(args: Options) -> dict:
    """Run each experiment of ``args.parts`` in turn; print and write the table of bars."""
    from dask_kvstate.backends.layout import UnsupportedModel

    results: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for part in args.parts:
        print(f"vs-raw: {part}", flush=True)
        t0 = time.perf_counter()
        try:
            results[part] = importlib.import_module(PARTS[part][0]).command(settings(part, args))
        except UnsupportedModel as e:  # refused before any engine started: the other experiments still run
            print(f"vs-raw: {part} left out: {e}", flush=True)
            skipped[part] = str(e)
            continue
        seconds[part] = time.perf_counter() - t0
    res = {
        "options": dataclasses.asdict(args),
        "cpu": cpu_model(),
        "seconds": seconds,
        "bars": summary(results),
        "left_out": {
            **skipped,
            **{f"{part}: {row}": why for part, r in results.items() for row, why in r.get("left_out", {}).items()},
        },
    }
    text = markdown(res)
    if args.out:
        write(res, Path(args.out), text)
    print(text)
    return res


def summary(results: dict[str, dict]) -> list[dict]:
    """One line per kvstate row and bar: the row's figure, the better raw variant's, their
    ratio (raw / row, so higher is better), whether it meets the bar, and outputs equal to
    the raw engine's."""
    lines = []
    for part, res in results.items():
        table = res["table"]
        raws = [n for n in table if raw_variant(n)]  # with more memory too (sessions-vs-raw)
        if not raws:
            continue
        identical = res.get("identical", {})
        for row, figures in table.items():
            for bar in BARS[part].get(row.split("/")[0], []):
                got = figures.get(bar.key)
                measured = [table[n][bar.key] for n in raws if table[n].get(bar.key) is not None]
                if got is None or not measured:
                    continue  # not measured in this run (a single round has no returning visit)
                raw = min(measured)
                ratio = raw / got if got > 0 and raw > 0 else None  # None: no ratio to hold to a bar
                lines.append(
                    {
                        "experiment": part,
                        "row": row,
                        "measure": bar.measure,
                        "raw_s": raw,
                        "row_s": got,
                        "ratio": ratio,
                        "target": bar.target,
                        "at_least": bar.at_least,
                        "met": ratio is not None and ratio >= bar.at_least,
                        "identical": figures.get("identical", identical.get(row, "-")),
                    }
                )
    return lines


def _ratio(line: dict) -> str:
    """The ratio as its bar says it: a speedup, a fraction of raw's time, or a change of raw's
    time; with two more digits where it is within 0.5% of the bar, so that rounding never
    shows a miss as the bar's own value."""
    ratio = line["ratio"]
    if ratio is None:
        return "n/a"
    more = 2 if abs(ratio / line["at_least"] - 1) < 0.005 else 0
    if line["target"].startswith("-"):
        return f"{100 * (1 / ratio - 1):+.{more}f}%"
    if line["target"].startswith("<="):
        return f"{1 / ratio:.{2 + more}f}x raw's"
    return f"{ratio:.{2 + more}f}x"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def markdown(res: dict) -> str:
    met = sum(line["met"] for line in res["bars"])
    took = ", ".join(f"`{part}` {_minutes(s)}" for part, s in res["seconds"].items())
    lines = [
        f"# kvstate against the raw engine, one run ({res.get('cpu', '')})",
        "",
        f"{took}; "
        f"each experiment's own report beside this one. Raw: the better of raw vLLM's variants per figure. "
        f"{met} of {len(res['bars'])} bars met.",
        "",
        "| experiment | row | measure | raw vLLM | kvstate | ratio | bar | met | outputs equal to raw's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for line in res["bars"]:
        lines.append(
            f"| {line['experiment']} | {line['row']} | {line['measure']} | {line['raw_s']:.3g} s | "
            f"{line['row_s']:.3g} s | {_ratio(line)} | {line['target']} | {'yes' if line['met'] else 'NO'} | "
            f"{line['identical']} |"
        )
    return "\n".join(lines + workload.left_out_lines(res.get("left_out", {}))) + "\n"


def write(res: dict, out: Path, text: str) -> None:
    """``vs_raw.{json,md,png}`` in ``out``; the png: each bar's ratio (raw / row) against its target."""
    plt = saved(res, out, "vs_raw", text)
    if plt is None or not any(b["ratio"] is not None for b in res["bars"]):
        return
    bars = [b for b in res["bars"] if b["ratio"] is not None]
    labels = [f"{b['experiment']}, {b['row']}\n{b['measure']}" for b in bars]
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(bars) + 1.4))
    ax.barh(labels, [b["ratio"] for b in bars], color=["tab:blue" if b["met"] else "tab:red" for b in bars])
    ax.plot([b["at_least"] for b in bars], range(len(bars)), "k|", ms=14, mew=2, label="bar")
    ax.axvline(1.0, color="0.5", lw=0.8)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("raw vLLM's time / kvstate's (log scale; > 1: kvstate sooner; black ticks: the bars)", fontsize=8)
    ax.set_title(f"kvstate against the raw engine ({res.get('cpu', '')})", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "vs_raw.png", dpi=120)
    plt.close(fig)
