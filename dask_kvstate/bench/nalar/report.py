"""The Nalar results as a markdown table, a bar plot, and the files a run leaves in its folder."""

from __future__ import annotations

import json
import os

from dask_kvstate.bench.nalar.workflows import Workflow


def table(rows: list[dict]) -> str:
    """Avg, P50, P95, P99 and max end-to-end latency per config, against ``default`` where it ran."""
    base = next((r for r in rows if r["config"] == "default"), None)
    lines = [
        "| workflow | config | requests | unfinished | avg s | P50 s | P95 s | P99 s | max s | "
        "avg vs default | P99 vs default |",
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


def write(out: str, wf: Workflow, rows: list[dict], md: str, command: str) -> None:
    """``<out>/<workflow>.md`` (the command, the workflow's settings, the table), ``.json`` and ``.png``."""
    with open(os.path.join(out, f"{wf.name}.md"), "w") as f:
        f.write(
            f"Command: {command}; rate {wf.rate}/s; roles at start {wf.roles}; hints {wf.hints}; "
            f"+hints rows add {wf.nalar_hints}\n\n{md}\n"
        )
    with open(os.path.join(out, f"{wf.name}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(out, f"{wf.name}.png"))
