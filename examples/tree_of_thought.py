"""Tree of thought on Dask: k branches explore one shared context, text replay vs kvstate.

Every branch reads the same incident report (~1,500 tokens) and answers its own
question. Text replay prefills the whole report once per branch; kvstate prefills it
once, forks the state, and each branch resumes from it (pulling the blocks when it
runs on another worker); "compiler" runs the text-replay code under
``kvs.stateflow()``, which inserts the state tasks by itself. The table compares
per-branch time to first token, total wall time, KV bytes and whether outputs are
token-identical. The workload and the table are :mod:`dask_kvstate.bench.tree_of_thought`.

Run: ``make demo [MODEL=gemma3-270m]`` or ``python examples/tree_of_thought.py [--model tiny-llama]``;
``--model`` also takes a local model folder or a local ``.gguf`` file.
"""

from __future__ import annotations

import argparse
import time

from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.backends import check_model_name, describe_known
from dask_kvstate.bench import tree_of_thought


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help=f"default smollm2-135m; one of: {describe_known()}")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--lines", type=int, default=52, help="log lines in the shared report (52: ~1,500 tokens)")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    try:
        check_model_name(args.model)  # before a cluster starts, not in each worker
    except ValueError as e:
        ap.error(str(e))
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            t0 = time.perf_counter()
            print(f"loading {args.model} on {args.workers} workers ...", flush=True)
            kvs.install(client, args.model, torch_threads=1)
            print(
                f"loaded in {time.perf_counter() - t0:.1f} s; running {args.branches} branches three ways", flush=True
            )
            m = tree_of_thought.run(client, branches=args.branches, lines=args.lines, new_tokens=args.new_tokens)
    print(tree_of_thought.table(m))
    return m


if __name__ == "__main__":
    main()
