"""The Nalar results as a markdown table, a bar plot, and the files a run leaves in its folder.

Every row is judged against ``default`` and against the best baseline of the same run
(the lowest avg, and separately the lowest P99, over the rows of
:data:`~dask_kvstate.bench.nalar.baselines.BASELINES`): beating stock Dask alone is no
claim when a user could have written a priority or profiled a split.
"""

from __future__ import annotations

import json
import os

from dask_kvstate.bench.nalar.baselines import BASELINES
from dask_kvstate.bench.nalar.workflows import Workflow


def split_name(split: dict[str, int]) -> str:
    """``planner=1,developer=7,tester=4``: a split as ``--roles`` takes it."""
    return ",".join(f"{r}={n}" for r, n in split.items())


def best_baselines(rows: list[dict]) -> tuple[dict | None, dict | None]:
    """The baseline row of the lowest avg and the one of the lowest P99 (None without baselines)."""
    base = [r for r in rows if r["config"] in BASELINES]
    if not base:
        return None, None
    return min(base, key=lambda r: r["avg"]), min(base, key=lambda r: r["p99"])


def _ratio(ref: dict | None, r: dict) -> str:
    return f"{ref['avg'] / r['avg']:.2f}x" if ref else "-"


def _p99_change(ref: dict | None, r: dict) -> str:
    """The P99 change of ``r`` against ``ref`` (negative: lower), ``-`` for ``ref`` itself."""
    return f"{100 * (r['p99'] / ref['p99'] - 1):+.0f}%" if ref and r is not ref else "-"


def table(rows: list[dict]) -> str:
    """Avg, P50, P95, P99 and max latency per config, against ``default`` and the best baseline."""
    default = next((r for r in rows if r["config"] == "default"), None)
    best_avg, best_p99 = best_baselines(rows)
    lines = [
        "| workflow | config | requests | unfinished | avg s | P50 s | P95 s | P99 s | max s | "
        "avg vs default | P99 vs default | avg vs best baseline | P99 vs best baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workflow']} | {r['config']} | {r['n']}/{r['offered']} | {r['unfinished']} | {r['avg']:.3f} | "
            f"{r['p50']:.3f} | {r['p95']:.3f} | {r['p99']:.3f} | {r['max']:.3f} | {_ratio(default, r)} | "
            f"{_p99_change(default, r)} | {_ratio(best_avg, r)} | {_p99_change(best_p99, r)} |"
        )
    return "\n".join(lines)


def best_line(rows: list[dict]) -> str:
    """Which baseline was best, for the header: ``best baseline: static-best (avg 0.912 s; P99 naive 2.310 s)``."""
    best_avg, best_p99 = best_baselines(rows)
    if best_avg is None or best_p99 is None:
        return "best baseline: none ran"
    avg, p99 = f"avg {best_avg['avg']:.3f} s", f"P99 {best_p99['config']} {best_p99['p99']:.3f} s"
    return f"best baseline: {best_avg['config']} ({avg}; {p99})"


def seed_table(rows: list[dict], first_seed: int = 0) -> str:
    """Each config's avg and P99 per seed, against the best baseline of that seed ('' for one seed).

    The main table's cells are medians over the seeds; this one shows the spread behind
    them, and ratios taken seed by seed (a seed's baselines saw the very same requests).

    >>> row = {"workflow": "w", "offered": 1, "n": 1, "unfinished": 0}
    >>> runs = lambda *ap: [{"avg": a, "p99": p} for a, p in ap]
    >>> print(seed_table([{**row, "config": "default", "runs": runs((2.0, 4.0), (3.0, 6.0))},
    ...                   {**row, "config": "kvstate", "runs": runs((1.0, 2.0), (2.0, 6.6))}]))
    | config | seed 0 avg / P99 s | seed 1 avg / P99 s | avg vs best baseline | P99 vs best baseline |
    |---|---|---|---|---|
    | default | 2.000 / 4.000 | 3.000 / 6.000 | 1.00x, 1.00x | -, - |
    | kvstate | 1.000 / 2.000 | 2.000 / 6.600 | 2.00x, 1.50x | -50%, +10% |
    """
    with_runs = [r for r in rows if len(r.get("runs", ())) > 1]
    if not with_runs:
        return ""
    n = min(len(r["runs"]) for r in with_runs)
    base = [r for r in with_runs if r["config"] in BASELINES]
    seeds = range(n)
    head = " | ".join(f"seed {first_seed + i} avg / P99 s" for i in seeds)
    lines = [
        f"| config | {head} | avg vs best baseline | P99 vs best baseline |",
        "|---" * (n + 3) + "|",
    ]
    for r in with_runs:
        cells = " | ".join(f"{r['runs'][i]['avg']:.3f} / {r['runs'][i]['p99']:.3f}" for i in seeds)
        avg_ratio, p99_change = ["-"] * n, ["-"] * n
        for i in seeds if base else ():
            best_avg = min(b["runs"][i]["avg"] for b in base)
            best_p99 = min(b["runs"][i]["p99"] for b in base)
            avg_ratio[i] = f"{best_avg / r['runs'][i]['avg']:.2f}x"
            mine = r["runs"][i]["p99"]
            if not (r["config"] in BASELINES and mine == best_p99):
                p99_change[i] = f"{100 * (mine / best_p99 - 1):+.0f}%"
        lines.append(f"| {r['config']} | {cells} | {', '.join(avg_ratio)} | {', '.join(p99_change)} |")
    return "\n".join(lines)


def grid_table(rows: list[dict]) -> str:
    """The ``static-best`` grid, every split run: its max utilisation in hindsight, avg and P99 ('' without one)."""
    row = next((r for r in rows if "grid" in r), None)
    if row is None:
        return ""
    offered = ", ".join(f"{r} {u:.2f}" for r, u in row["offered_units"].items())
    lines = [
        f"static-best grid ({row['grid_duration']} s a run; offered units: {offered}), best: "
        f"{split_name(row['roles'])}",
        "",
        "| split | max utilisation | avg s | P99 s | unfinished |",
        "|---|---|---|---|---|",
    ]
    for g in row["grid"]:
        lines.append(
            f"| {split_name(g['split'])} | {g['max_util']:.2f} | {g['avg']:.3f} | {g['p99']:.3f} | {g['unfinished']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Bars of avg, P50, P95, P99 per config, saved as a PNG at ``path`` (needs matplotlib)."""
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


def write(out: str, wf: Workflow, rows: list[dict], md: str, command: str, first_seed: int = 0) -> None:
    """``<out>/<workflow>.md`` (the command, the workflow's settings, the best baseline, the table,
    with repeats the per-seed table, and the grid), ``.json`` and ``.png``."""
    layout = f"; workers {wf.workers}" if wf.workers is not None else ""
    with open(os.path.join(out, f"{wf.name}.md"), "w") as f:
        f.write(
            f"Command: {command}; rate {wf.rate}/s; roles at start {wf.roles}{layout}; hints {wf.hints}; "
            f"+hints rows add {wf.nalar_hints}; {best_line(rows)}\n\n{md}\n"
        )
        seeds = seed_table(rows, first_seed)
        if seeds:
            f.write(f"\nPer seed (the cells above are medians over these):\n\n{seeds}\n")
        grid = grid_table(rows)
        if grid:
            f.write(f"\n{grid}\n")
    with open(os.path.join(out, f"{wf.name}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(out, f"{wf.name}.png"))
