"""Each workflow shape with the stateful compiler off and on: prefill tokens, wall time, identity.

Run: ``python examples/compiler_shapes.py [--model tiny-llama]``. Every shape is plain
``kvs.generate`` calls (see ``dask_kvstate/testing/shapes.py``); ``with kvs.stateflow()`` is the only change.
"""

from __future__ import annotations

import argparse
import time

import dask
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate import progress
from dask_kvstate.testing import shapes


def _prefill(client) -> int:
    return sum(s.get("prefill_tokens", 0) for s in kvs.stats(client).workers.values())


def measure(client, build) -> dict:
    row = {}
    for mode in ("off", "on"):
        outs = build()
        before, t0 = _prefill(client), time.perf_counter()
        if mode == "on":
            with kvs.stateflow():
                res = dask.compute(*outs)
        else:
            res = dask.compute(*outs)
        row[mode] = {
            "tokens": _prefill(client) - before,
            "wall": time.perf_counter() - t0,
            "ids": [r.token_ids for r in res],
        }
    row["calls"] = len(outs)
    row["states"] = len(kvs.explain(*build()).plan.states)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    args = ap.parse_args(argv)
    rows = {}
    for name, build in progress.bar(shapes.SHAPES.items(), total=len(shapes.SHAPES), desc="shapes", unit="shape"):
        # A fresh cluster per shape: no shape profits from blocks another left in the stores.
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
            with Client(cluster) as client:
                kvs.install(client, args.model, torch_threads=1)
                progress.write(f"{name} ...")
                rows[name] = measure(client, build)
    print(f"{'shape':>16} | calls | states | prefill tokens off -> on | wall off -> on     | identical")
    print("-" * 86)
    for name, r in rows.items():
        same = "yes" if r["off"]["ids"] == r["on"]["ids"] else "NO"
        print(
            f"{name:>16} | {r['calls']:>5} | {r['states']:>6} | {r['off']['tokens']:>8} -> {r['on']['tokens']:<6} "
            f"({r['off']['tokens'] / max(r['on']['tokens'], 1):.2f}x) | {r['off']['wall']:.2f} s -> {r['on']['wall']:.2f} s"
            f" | {same}"
        )
    return rows


if __name__ == "__main__":
    main()
