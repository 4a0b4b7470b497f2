"""The AAFLOW+ suite of the bench command: pick experiments, a grid (full or ``--quick``), a folder.

The five experiments (and ``overhead``) share one set of options and run together, so
their rows come from the same clusters and prompts. :mod:`dask_kvstate.bench.registry`
routes a command line here when it names one of them, starts with a flag or is empty::

    python -m dask_kvstate.bench                       # all five, SmolLM2, the full grid
    python -m dask_kvstate.bench ttft scaling --quick  # tiny-llama, small grid (minutes)
    python -m dask_kvstate.bench 1 2 --lengths 512 1024 --agents 16 --out bench-results/mine
    python -m dask_kvstate.bench ttft scaling --backends hf vllm  # vLLM rows beside the HF rows

Experiments 1, 2, 4 and 5 run once per backend (``--backends``; default: the
transformers backend, and vLLM beside it where the ``vllm`` extra is installed and
serves the model), on the same prompts, each with its own baselines.
"""

from __future__ import annotations

import datetime
import importlib.util
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dask_kvstate.backends import check_model_name, describe_known
from dask_kvstate.backends.models import GEMMA3, TINY_LLAMA
from dask_kvstate.bench import registry
from dask_kvstate.bench.options import to_argv

BACKENDS = ("hf", "vllm")
# Known models the vLLM backend does not serve: one built in memory, one with sliding-window layers.
NOT_ON_VLLM = (TINY_LLAMA, GEMMA3)

NUMBERS = {"1": "ttft", "2": "scaling", "3": "crossover", "4": "memory", "5": "throughput"}

# The paper's grid (AAFLOW+ section 6), and a small one that finishes in minutes on two cores.
FULL = {
    "model": "smollm2-135m",
    "lengths": [512, 1024, 2048, 4096],
    "agents": 16,
    "ttft_new_tokens": 4,
    "scaling_context": 4096,
    "ks": [1, 2, 4, 8, 16],
    "new_tokens": 64,
    "bandwidths": ["10 Mbit/s", "100 Mbit/s", "1 Gbit/s", "10 Gbit/s"],
    "contexts": [256, 512, 1024, 2048, 4096],
    "repeats": 3,
    "overhead_tasks": 10_000,
    "overhead_repeats": 2,
    "memory_context": 4096,
}
QUICK = {
    "model": "tiny-llama",
    "lengths": [128, 256, 512],
    "agents": 16,
    "ttft_new_tokens": 4,
    "scaling_context": 512,
    "ks": [1, 4, 16],
    "new_tokens": 16,
    "bandwidths": ["100 Mbit/s", "10 Gbit/s"],
    "contexts": [256, 2048],
    "repeats": 1,
    "overhead_tasks": 2_000,
    "overhead_repeats": 1,
    "memory_context": 256,
}


@dataclass
class Options:
    """The suite's settings: which experiments, the grid (``None``: the full or ``--quick`` grid's value), where to."""

    experiments: list[str] = field(
        default_factory=list,
        metadata={
            "help": "ttft scaling crossover memory throughput (or 1-5; throughput includes overhead, which also "
            "runs alone); default: all five",
            "positional": True,
            "metavar": "experiment",
        },
    )
    quick: bool = field(default=False, metadata={"help": "tiny-llama and a small grid (a few minutes)"})
    model: str | None = field(
        default=None, metadata={"help": f"default smollm2-135m, or tiny-llama with --quick; one of: {describe_known()}"}
    )
    out: Path | None = field(default=None, metadata={"help": "results folder (default: bench-results/<model>-<time>)"})
    workers: int = field(default=2, metadata={"help": "worker processes"})
    lengths: list[int] | None = field(default=None, metadata={"help": "experiment 1's context lengths L"})
    agents: int | None = field(default=None, metadata={"help": "experiment 1's number of agents"})
    ks: list[int] | None = field(
        default=None, metadata={"help": "experiment 2's agent counts (also 4's branch factors)"}
    )
    scaling_context: int | None = field(default=None, metadata={"help": "experiment 2's context length"})
    new_tokens: int | None = field(default=None, metadata={"help": "experiment 2's tokens generated per agent (Y)"})
    memory_context: int | None = field(
        default=None, metadata={"help": "context length of experiment 4's all-branches-live runs"}
    )
    overhead_tasks: int | None = field(
        default=None, metadata={"help": "size of experiment 5's non-LLM graph (default: the grid's)"}
    )
    overhead_repeats: int | None = field(default=None, metadata={"help": "measured rounds of the non-LLM graph"})
    links: str = field(
        default="throttle",
        metadata={
            "help": "experiment 3's links: the config throttle, or also real shaped links between network "
            "namespaces (root)",
            "choices": ("throttle", "netns"),
        },
    )
    variants: list[str] | None = field(
        default=None, metadata={"help": "experiment 2's variants (replay prefix kvstate kvstate-unbatched)"}
    )
    backends: list[str] | None = field(
        default=None,
        metadata={
            "help": "backends experiments 1, 2, 4 and 5 run on, one after the other (default: hf, and vllm beside "
            "it where the vllm extra is installed and serves the model)",
            "choices": BACKENDS,
        },
    )

    def __post_init__(self):
        # Checked before a cluster starts; a ValueError here is the command line's error.
        if self.model is not None:
            check_model_name(self.model)
        wanted = []
        for e in self.experiments or list(NUMBERS.values()):
            name = NUMBERS.get(e, e)
            if name not in (*NUMBERS.values(), "overhead"):
                raise ValueError(
                    f"unknown experiment {e!r} among the AAFLOW+ ones; choose from "
                    f"{', '.join(NUMBERS.values())}, overhead or 1-5 (any other experiment runs alone)"
                )
            wanted.append(name)
        self.experiments = list(dict.fromkeys(wanted))


def parse(argv: list[str] | None = None) -> Options:
    """The suite's options of a command line (argparse's exit if it names no AAFLOW+ experiment)."""
    exp, opts = registry.parse(argv)
    if not exp.suite:
        registry.top_parser().error(f"{exp.name!r} is not one of the AAFLOW+ experiments")
    return opts


def main(argv: list[str] | None = None) -> Any:
    """The bench command, :func:`dask_kvstate.bench.registry.main`; the suite returns its results dict."""
    return registry.main(argv)


def default_backends(model: str) -> list[str]:
    """``hf``, and ``vllm`` where vLLM is installed and serves ``model``."""
    if importlib.util.find_spec("vllm") is None or model in NOT_ON_VLLM:
        return ["hf"]
    return ["hf", "vllm"]


def grid(opts: Options) -> dict:
    g = dict(QUICK if opts.quick else FULL)
    if opts.model:
        g["model"] = opts.model
    g["backends"] = list(dict.fromkeys(opts.backends or default_backends(str(g["model"]))))
    for name in (
        "lengths",
        "agents",
        "ks",
        "scaling_context",
        "new_tokens",
        "overhead_tasks",
        "overhead_repeats",
        "memory_context",
    ):
        if getattr(opts, name) is not None:
            g[name] = getattr(opts, name)
    return g


def _steps(exps, g) -> int:
    n = 0
    if "ttft" in exps:
        n += 3 * len(g["lengths"]) * len(g["backends"])
    if {"scaling", "memory", "throughput"} & set(exps):
        n += 4 * len(g["ks"]) * len(g["backends"])
    if "crossover" in exps:
        n += len(g["bandwidths"]) * len(g["contexts"])
    if "memory" in exps:
        n += 4 * len(g["ks"])
    if {"throughput", "overhead"} & set(exps):
        n += g["overhead_repeats"] + 1
    return n


def run(opts: Options) -> dict:
    """Run the chosen experiments and write their results; returns the results dict."""
    from distributed import Client, LocalCluster

    import dask_kvstate as kvs
    from dask_kvstate import progress
    from dask_kvstate.bench import experiments as ex
    from dask_kvstate.bench import overhead, report, workload

    g = grid(opts)
    variants = tuple(opts.variants or ex.VARIANTS)
    for required in ("replay", "prefix", "kvstate"):
        if required not in variants:
            variants = (required, *variants)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    out = opts.out or Path("bench-results") / f"{Path(g['model']).name}-{stamp:%Y%m%d-%H%M%S}"
    exps = opts.experiments
    res: dict = {
        "meta": {
            "model": g["model"],
            "quick": opts.quick,
            "experiments": exps,
            "grid": g,
            "command": " ".join([registry.PROG, *to_argv(opts)]),
            "machine": f"{platform.machine()} {platform.system()}, {__import__('os').cpu_count()} CPUs",
            "workers": opts.workers,
            "started": f"{stamp:%Y-%m-%d %H:%M} UTC",
            "scaling_context": g["scaling_context"],
            "new_tokens": g["new_tokens"],
        }
    }
    t0 = time.perf_counter()

    def checkpoint():
        # A long run keeps what it measured so far, whatever happens later.
        res["meta"]["seconds"] = time.perf_counter() - t0
        report.write(res, out)

    bar = progress.bar(total=_steps(exps, g), desc="bench", unit="run")
    try:
        llm = {"ttft", "scaling", "memory", "throughput"} & set(exps)
        for backend in g["backends"] if llm else []:
            # The transformers backend computes one task at a time per worker thread; a vLLM
            # engine steps every request its worker holds, so its workers take all agents at once.
            threads = 1 if backend == "hf" else -(-max(g["agents"], *g["ks"]) // opts.workers)
            res["meta"].setdefault("threads", {})[backend] = threads
            with (
                LocalCluster(
                    n_workers=opts.workers, threads_per_worker=threads, processes=True, dashboard_address=":0"
                ) as cluster,
                Client(cluster) as client,
            ):
                progress.write(f"loading {g['model']} on {opts.workers} workers, {backend} backend ...")
                kvs.install(client, g["model"], backend=backend, torch_threads=1 if backend == "hf" else None)
                client.run(workload.warm_up)
                setup = ex.Setup(client, backend)
                bpt = workload.kv_bytes_per_token(client)
                res["meta"]["kv_bytes_per_token"] = bpt
                ctx = workload.contexts(client, sorted({*g["lengths"], g["scaling_context"]}))
                if "ttft" in exps:
                    res.setdefault("ttft", []).extend(
                        ex.ttft_vs_context(
                            setup, {L: ctx[L] for L in g["lengths"]}, g["agents"], g["ttft_new_tokens"], bar
                        )
                    )
                    checkpoint()
                if {"scaling", "memory", "throughput"} & set(exps):
                    rows = ex.scaling(setup, ctx[g["scaling_context"]], g["ks"], g["new_tokens"], bar, variants)
                    res.setdefault("scaling", []).extend(rows)
                    if "memory" in exps:
                        res.setdefault("memory", []).extend(ex.memory(rows, bpt))
                    if "throughput" in exps:
                        res.setdefault("throughput", []).extend(ex.throughput(rows))
                    checkpoint()
        if len(g["backends"]) > 1:
            res["backend_agreement"] = {
                name: ex.backend_agreement(res[name], key)
                for name, key in (("ttft", "L"), ("scaling", "k"))
                if name in res
            }
        if "memory" in exps:
            res["memory_live"] = ex.memory_live(
                g["model"], g["memory_context"], g["ks"], g["new_tokens"], opts.workers, bar
            )
            checkpoint()
        if "crossover" in exps:
            res["crossover"] = ex.crossover_sweep(g["model"], g["bandwidths"], g["contexts"], g["repeats"], bar)
            if opts.links == "netns":
                from dask_kvstate.bench import crossover_netns

                res["crossover_netns"] = crossover_netns.sweep(g["model"], g["repeats"], contexts=g["contexts"])
                crossover_netns.write(res["crossover_netns"], str(out / "crossover-netns"))
            checkpoint()
        if {"throughput", "overhead"} & set(exps):
            res["overhead"] = overhead.overhead(g["model"], g["overhead_tasks"], g["overhead_repeats"], bar)
    finally:
        bar.close()
    res["meta"]["seconds"] = time.perf_counter() - t0
    files = report.write(res, out)
    print(report.markdown(res))
    print(f"\nwrote {', '.join(str(p) for p in files.values())}")
    return res
