"""Command line of the bench: pick experiments, a grid (full or ``--quick``), a folder.

::

    python -m dask_kvstate.bench                       # all five, SmolLM2, the full grid
    python -m dask_kvstate.bench ttft scaling --quick  # tiny-llama, small grid (minutes)
    python -m dask_kvstate.bench 1 2 --lengths 512 1024 --agents 16 --out bench-results/mine
    python -m dask_kvstate.bench ttft scaling --backends hf vllm  # vLLM rows beside the HF rows

Experiments 1, 2, 4 and 5 run once per backend (``--backends``; default: the
transformers backend, and vLLM beside it where the ``vllm`` extra is installed and
serves the model), on the same prompts, each with its own baselines.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import platform
import sys
import time
from pathlib import Path

from dask_kvstate.backends import check_model_name, describe_known
from dask_kvstate.backends.models import GEMMA3, TINY_LLAMA

BACKENDS = ("hf", "vllm")
# Known models the vLLM backend does not serve: one built in memory, one with sliding-window layers.
NOT_ON_VLLM = (TINY_LLAMA, GEMMA3)

EXPERIMENTS = {"1": "ttft", "2": "scaling", "3": "crossover", "4": "memory", "5": "throughput"}

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


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dask_kvstate.bench", description=__doc__.splitlines()[0])
    ap.add_argument(
        "experiments",
        nargs="*",
        metavar="experiment",
        help="ttft scaling crossover memory throughput (or 1-5; throughput includes "
        "overhead, which also runs alone); default: all",
    )
    ap.add_argument("--quick", action="store_true", help="tiny-llama and a small grid (a few minutes)")
    ap.add_argument(
        "--model",
        help=f"default smollm2-135m, or tiny-llama with --quick; one of: {describe_known()}",
    )
    ap.add_argument("--out", type=Path, help="results folder (default: bench-results/<model>-<time>)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", help="experiment 1's context lengths L")
    ap.add_argument("--agents", type=int, help="experiment 1's number of agents")
    ap.add_argument("--ks", type=int, nargs="+", help="experiment 2's agent counts (also 4's branch factors)")
    ap.add_argument("--scaling-context", type=int, help="experiment 2's context length")
    ap.add_argument("--new-tokens", type=int, help="experiment 2's tokens generated per agent (Y)")
    ap.add_argument("--memory-context", type=int, help="context length of experiment 4's all-branches-live runs")
    ap.add_argument("--overhead-tasks", type=int, help="size of experiment 5's non-LLM graph (default 10,000)")
    ap.add_argument("--overhead-repeats", type=int, help="measured rounds of the non-LLM graph")
    ap.add_argument(
        "--links",
        choices=["throttle", "netns"],
        default="throttle",
        help="experiment 3's links: the config throttle, or also real shaped links between network namespaces (root)",
    )
    ap.add_argument("--variants", nargs="+", help="experiment 2's variants (replay prefix kvstate kvstate-unbatched)")
    ap.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        help="backends experiments 1, 2, 4 and 5 run on, one after the other (default: hf, and vllm beside it "
        "where the vllm extra is installed and serves the model)",
    )
    args = ap.parse_args(argv)
    if args.model is not None:
        try:
            check_model_name(args.model)
        except ValueError as bad:
            ap.error(str(bad))
    wanted = []
    for e in args.experiments or list(EXPERIMENTS.values()):
        name = EXPERIMENTS.get(e, e)
        if name not in (*EXPERIMENTS.values(), "overhead"):
            ap.error(f"unknown experiment {e!r}; choose from {', '.join(EXPERIMENTS.values())}, overhead or 1-5")
        wanted.append(name)
    args.experiments = list(dict.fromkeys(wanted))
    return args


def default_backends(model: str) -> list[str]:
    """``hf``, and ``vllm`` where vLLM is installed and serves ``model``."""
    if importlib.util.find_spec("vllm") is None or model in NOT_ON_VLLM:
        return ["hf"]
    return ["hf", "vllm"]


def grid(args) -> dict:
    g = dict(QUICK if args.quick else FULL)
    if args.model:
        g["model"] = args.model
    g["backends"] = list(dict.fromkeys(args.backends or default_backends(str(g["model"]))))
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
        if getattr(args, name) is not None:
            g[name] = getattr(args, name)
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


def main(argv=None) -> dict:
    """Run the chosen experiments and write their results; returns the results dict."""
    from distributed import Client, LocalCluster

    import dask_kvstate as kvs
    from dask_kvstate import progress
    from dask_kvstate.bench import experiments as ex
    from dask_kvstate.bench import overhead, report, workload

    args = parse(argv)
    g = grid(args)
    variants = tuple(args.variants or ex.VARIANTS)
    for required in ("replay", "prefix", "kvstate"):
        if required not in variants:
            variants = (required, *variants)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or Path("bench-results") / f"{Path(g['model']).name}-{stamp:%Y%m%d-%H%M%S}"
    exps = args.experiments
    res: dict = {
        "meta": {
            "model": g["model"],
            "quick": args.quick,
            "experiments": exps,
            "grid": g,
            "command": "python -m dask_kvstate.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()} {platform.system()}, {__import__('os').cpu_count()} CPUs",
            "workers": args.workers,
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
            threads = 1 if backend == "hf" else -(-max(g["agents"], *g["ks"]) // args.workers)
            res["meta"].setdefault("threads", {})[backend] = threads
            with (
                LocalCluster(
                    n_workers=args.workers, threads_per_worker=threads, processes=True, dashboard_address=":0"
                ) as cluster,
                Client(cluster) as client,
            ):
                progress.write(f"loading {g['model']} on {args.workers} workers, {backend} backend ...")
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
                g["model"], g["memory_context"], g["ks"], g["new_tokens"], args.workers, bar
            )
            checkpoint()
        if "crossover" in exps:
            res["crossover"] = ex.crossover_sweep(g["model"], g["bandwidths"], g["contexts"], g["repeats"], bar)
            if args.links == "netns":
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
