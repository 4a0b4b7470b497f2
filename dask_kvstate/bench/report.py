"""Write a bench run: ``results.json``, ``report.md`` (markdown tables) and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

MIB = 2**20


def _table(header: list[str], rows: list[list]) -> str:
    def fmt(x):
        if x is None:  # not measured for this row (a vLLM row's store peak, say)
            return "-"
        if isinstance(x, bool):
            return "yes" if x else "NO"
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def _section(title: str, note: str, columns: str, rows: list[dict]) -> list[str]:
    """A titled markdown table. ``columns`` reads ``"header=key | header=key | ..."``: each
    column's header and the key of ``rows`` it shows; keys ending in ``_bytes`` show MiB."""
    pairs = [[p.strip() for p in column.split("=")] for column in columns.split("|")]
    cells = [[r[k] / MIB if k.endswith("_bytes") and r[k] is not None else r[k] for _, k in pairs] for r in rows]
    return [*([title, ""] if title else []), note, "", _table([h for h, _ in pairs], cells), ""]


def _by_backend(columns: str, rows: list[dict]) -> str:
    """``columns`` led by a backend column where the rows come from more than one backend run."""
    return f"backend=backend | {columns}" if any("backend" in r for r in rows) else columns


def _backends(res: dict) -> list[str]:
    rows = [*res.get("ttft", []), *res.get("scaling", [])]
    return list(dict.fromkeys(r.get("backend", "hf") for r in rows))


VLLM_VARIANTS = (
    "vLLM rows: one vLLM engine per worker, the worker's tasks sharing its steps; replay = text replay on engines "
    "that do not read their prefix cache (vLLM with prefix caching off), prefix = the same requests on engines "
    "that do (vLLM's own prefix cache, one per worker, Dask placing requests), kvstate = our states loaded into "
    "those engines by our KV connector. TTFT counts from a task's start: a vLLM worker takes all its agents at once, "
    "so their TTFT includes the engine steps they share with each other, while a transformers worker thread runs "
    "one agent at a time."
)


def markdown(res: dict) -> str:
    meta = res["meta"]
    threads = meta.get("threads", {"hf": 1})
    out = [
        f"# dask-kvstate bench: {meta['model']}{' (quick)' if meta['quick'] else ''}",
        "",
        f"`{meta['command']}` on {meta['machine']}, {meta['workers']} workers x "
        + ", ".join(f"{n} thread{'s' * (n > 1)} ({b})" for b, n in threads.items())
        + f", {meta['started']}, {meta['seconds']:.0f} s in all. Every baseline ran in this same session on the same "
        "cluster and prompts; ratios are side by side measurements.",
        "",
    ]
    if "vllm" in _backends(res):
        out += [VLLM_VARIANTS, ""]
    for name, a in res.get("backend_agreement", {}).items():
        out += [
            f"Greedy text replay, vLLM against transformers ({name} runs): {a['equal']} of {a['agents']} agents "
            "token-identical"
            + (f"; the others first differ at tokens {a['first_divergence']}." if a["first_divergence"] else "."),
            "",
        ]
    if "ttft" in res:
        out += _section(
            "## 1. TTFT vs context length",
            f"{res['ttft'][0]['agents']} agents, suffix ~32 tokens; median per-agent time to first token "
            "(kvstate unbatched: TTFT is a per-request latency).",
            _by_backend(
                "L=L | context tok=context_tokens | replay s=ttft_replay_s | prefix cache s=ttft_prefix_s | "
                "kvstate s=ttft_kvstate_s | vs replay=speedup_vs_replay | vs prefix=speedup_vs_prefix | "
                "fork ms=fork_ms | identical=identical",
                res["ttft"],
            ),
            res["ttft"],
        )
    if "scaling" in res:
        variants = " | ".join(f"{v}=wall_{v}_s" for v in (r["variant"] for r in res["scaling"][0]["runs"]))
        out += _section(
            "## 2. Multi-agent scaling",
            f"L = {meta['scaling_context']} tokens, Y = {meta['new_tokens']}; aggregate wall time (s).",
            _by_backend(
                f"k=k | {variants} | kvstate vs replay=speedup_vs_replay | kvstate vs prefix=speedup_vs_prefix | "
                "identical=identical",
                res["scaling"],
            ),
            res["scaling"],
        )
    if "crossover" in res:
        out += _section(
            "## 3. Transfer vs recompute crossover",
            "`dask_kvstate.bench.crossover.sweep_cell`: the rule's choice vs both options measured.",
            "bandwidth=bandwidth | tokens=tokens | MiB=mib | rule=choice | pull s=t_pull | recompute s=t_recompute | "
            "right=right",
            res["crossover"],
        )
    peaks = (
        "branches=branches | peak replay MiB=peak_replay_bytes | peak prefix MiB=peak_prefix_bytes | "
        "peak kvstate MiB=peak_kvstate_bytes"
    )
    if "memory" in res:
        out += _section(
            "## 4. KV memory vs branch factor",
            "Peak: most KV held at once (block store device tier + live decode caches, summed over workers; "
            "not measured for vLLM rows, whose engines hold KV in their own paged cache). "
            "Computed: KV bytes prefilled.",
            _by_backend(
                f"{peaks} | replay/kvstate=peak_ratio_vs_replay | prefix/kvstate=peak_ratio_vs_prefix | "
                "computed replay MiB=computed_replay_bytes | computed kvstate MiB=computed_kvstate_bytes | "
                "computed ratio=computed_ratio_vs_replay",
                res["memory"],
            ),
            res["memory"],
        )
    if "memory_live" in res:
        live = res["memory_live"]
        out += _section(
            "### 4b. Peak KV with every branch in flight",
            f"A cluster whose workers run {live[0]['threads']} tasks at once, so all k agents of every mode are live "
            f"together; context {live[0]['context_tokens']} tokens.",
            f"{peaks} | replay/kvstate=ratio_vs_replay | prefix/kvstate=ratio_vs_prefix | identical=identical",
            live,
        )
        if "peak_kvstate_one_copy_bytes" in live[0]:
            out += _section(
                "",
                "kvstate with `placement.max-copies: 1` (one copy of the state; every branch on its holder) against "
                "default placement (a copy on each worker that runs branches), and what it costs in time:",
                "branches=branches | one copy MiB=peak_kvstate_one_copy_bytes | "
                "replay/one copy=one_copy_ratio_vs_replay | prefix/one copy=one_copy_ratio_vs_prefix | "
                "kvstate wall s=wall_kvstate_s | one copy wall s=wall_kvstate_one_copy_s",
                live,
            )
    if "throughput" in res:
        out += _section(
            "## 5. Throughput and framework overhead",
            "Omega = worker busy time (wall x workers) - (prefill + decode time inside the model); not for vLLM "
            "rows, whose requests share engine steps.",
            _by_backend(
                "variant=variant | k=k | wall s=wall_s | tokens=generated_tokens | tokens/s=tokens_per_s | "
                "model s=model_s | Omega s=omega_s | Omega %=omega_pct",
                res["throughput"],
            ),
            res["throughput"],
        )
    if "overhead" in res:
        out += _overhead(res["overhead"])
    return "\n".join(out)


def _overhead(o: dict) -> list[str]:
    out = [
        f"Plugins on a {o['tasks']}-task non-LLM graph (median of {o['repeats']}): plain Dask "
        f"{o['median_s']['plain']:.2f} s, with the kvstate plugins {o['median_s']['plugins']:.2f} s "
        f"({o['overhead_pct']:+.1f}%), plugins + compiler pass {o['median_s']['plugins+compiler']:.2f} s "
        f"({o['overhead_with_compiler_pct']:+.1f}%).",
        "",
    ]
    if "cpu_median_s" in o:  # results of runs without the CPU profile lack these
        rows = [
            {
                "column": k,
                "median": o["median_s"][k],
                "spread": "{:.2f}-{:.2f}".format(*o["spread_s"][k]),
                "scheduler": o["scheduler_us_per_task"][k],
                "workers": o["worker_us_per_task"][k],
            }
            for k in o["median_s"]
        ]
        columns = [
            ("column", "column"),
            ("wall median s", "median"),
            ("wall min-max s", "spread"),
            ("scheduler+client CPU us/task", "scheduler"),
            ("workers CPU us/task", "workers"),
        ]
        out += [
            _table([c[0] for c in columns], [[r[c[1]] for c in columns] for r in rows]),
            "",
            f"CPU overhead of the plugins: scheduler {o['scheduler_cpu_overhead_pct']:+.1f}%, workers "
            f"{o['worker_cpu_overhead_pct']:+.1f}%. Load average (1, 5, 15 min) at start "
            f"{o['load_average']['start']}, at end {o['load_average']['end']}.",
            "",
        ]
    return out


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None where matplotlib is not
    installed (the reports' tables and json are written without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def saved(res: dict, out: Path, stem: str, text: str):
    """``res`` as ``<stem>.json`` and ``text`` as ``<stem>.md`` in ``out`` (made if missing);
    then :func:`pyplot` for the report's plot, None where matplotlib is not installed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text(text)
    return pyplot()


def plots(res: dict, out: Path) -> list[str]:
    """PNG plots of what ran; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)

    backends = _backends(res)

    def of(rows: list[dict], backend: str) -> list[dict]:
        return [r for r in rows if r.get("backend", "hf") == backend]

    def named(backend: str, label: str) -> str:
        return f"{backend}: {label}" if len(backends) > 1 else label

    def style(backend: str) -> str:
        return "--" if backend == "vllm" else "-"  # one line style per backend, one colour per variant

    if "ttft" in res:
        fig, ax = plt.subplots(figsize=(6, 4))
        for backend in backends:
            rows = of(res["ttft"], backend)
            for i, (key, label) in enumerate(
                (
                    ("ttft_replay_s", "text replay"),
                    ("ttft_prefix_s", "local prefix cache"),
                    ("ttft_kvstate_s", "kvstate"),
                )
            ):
                xs, ys = [r["L"] for r in rows], [r[key] for r in rows]
                ax.plot(xs, ys, style(backend), color=f"C{i}", marker="o", label=named(backend, label))
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="context tokens L",
            ylabel="median TTFT (s)",
            title="Exp 1: TTFT vs context",
        )
        ax.legend(fontsize=8)
        save(fig, "exp1_ttft.png")
    if "scaling" in res:
        fig, ax = plt.subplots(figsize=(6, 4))
        ks = sorted({r["k"] for r in res["scaling"]})
        for backend in backends:
            rows = of(res["scaling"], backend)
            for i, v in enumerate([r["variant"] for r in rows[0]["runs"]] if rows else []):
                walls = [r[f"wall_{v}_s"] for r in rows]
                ax.plot(
                    [r["k"] for r in rows], walls, style(backend), color=f"C{i}", marker="o", label=named(backend, v)
                )
        ax.set(xscale="log", xlabel="agents k", ylabel="aggregate wall time (s)", title="Exp 2: multi-agent scaling")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.tick_params(axis="x", which="minor", labelbottom=False)
        ax.legend()
        save(fig, "exp2_scaling.png")
    if "crossover" in res:
        fig, ax = plt.subplots(figsize=(6, 4))
        for bw in dict.fromkeys(c["bandwidth"] for c in res["crossover"]):
            cells = [c for c in res["crossover"] if c["bandwidth"] == bw]
            ax.plot([c["tokens"] for c in cells], [c["t_pull"] for c in cells], marker="o", label=f"pull @ {bw}")
        cells = [c for c in res["crossover"] if c["bandwidth"] == res["crossover"][0]["bandwidth"]]
        ax.plot([c["tokens"] for c in cells], [c["t_recompute"] for c in cells], "k--", marker="s", label="recompute")
        ax.set(
            xscale="log", yscale="log", xlabel="context tokens", ylabel="seconds", title="Exp 3: transfer vs recompute"
        )
        ax.legend(fontsize=8)
        save(fig, "exp3_crossover.png")
    if "memory" in res:
        fig, ax = plt.subplots(figsize=(6, 4))
        bs = sorted({r["branches"] for r in res["memory"]})
        for backend in backends:
            rows = of(res["memory"], backend)
            xs = [r["branches"] for r in rows]
            for v in ("replay", "prefix", "kvstate"):
                if rows and rows[0][f"peak_{v}_bytes"] is not None:
                    ax.plot(
                        xs, [r[f"peak_{v}_bytes"] / MIB for r in rows], marker="o", label=named(backend, f"peak {v}")
                    )
                ax.plot(
                    xs,
                    [r[f"computed_{v}_bytes"] / MIB for r in rows],
                    ls=":",
                    marker=".",
                    label=named(backend, f"computed {v}"),
                )
        ax.set(xscale="log", xlabel="branch factor", ylabel="KV MiB", title="Exp 4: KV memory vs branches")
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.legend(fontsize=8)
        if "memory_live" in res:
            live = res["memory_live"]
            for v in ("replay", "prefix", "kvstate", "kvstate_one_copy"):
                if f"peak_{v}_bytes" in live[0]:
                    ax.plot(
                        [r["branches"] for r in live],
                        [r[f"peak_{v}_bytes"] / MIB for r in live],
                        ls="--",
                        marker="^",
                        label=f"peak {v.replace('_', ' ')}, all live",
                    )
        save(fig, "exp4_memory.png")
    if "throughput" in res:
        fig, ax = plt.subplots(figsize=(6, 4))
        rows = res["throughput"]
        ax.bar([named(r.get("backend", "hf"), r["variant"]) for r in rows], [r["tokens_per_s"] for r in rows])
        ax.tick_params(axis="x", labelrotation=30 if len(backends) > 1 else 0)
        ax.set(ylabel="generated tokens/s", title=f"Exp 5: throughput at k={rows[0]['k']}")
        save(fig, "exp5_throughput.png")
    return made


def write(res: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    files = {"json": out / "results.json"}
    res["meta"]["plots"] = plots(res, out)
    md = markdown(res) + "\n" + "\n".join(f"![{p}]({p})" for p in res["meta"]["plots"]) + "\n"
    (out / "report.md").write_text(md)
    files["markdown"] = out / "report.md"
    files.update({p: out / p for p in res["meta"]["plots"]})
    return files
