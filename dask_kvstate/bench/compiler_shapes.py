"""Each workflow shape with the stateful compiler off and on: prefill tokens, wall time, identity.

Every shape of :mod:`dask_kvstate.testing.shapes` is plain ``kvs.generate`` calls;
``with kvs.stateflow()`` is the only change between the two runs, on a fresh cluster
per shape so no shape profits from blocks another left in the stores. The table says
how many prefill tokens the compiler saved and whether the outputs stayed
token-identical. ``python -m dask_kvstate.bench compiler-shapes``
(``examples/compiler_shapes.py``) runs :func:`command`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import dask
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate import progress
from dask_kvstate.bench import workload
from dask_kvstate.testing import shapes


@dataclass
class Options:
    """The model the shapes run on."""

    model: str = field(default="tiny-llama", metadata={"help": "the model both workers install"})


def measure(client, build) -> dict:
    """One shape, compiler off then on: prefill tokens, wall time and token ids of each; calls and states."""
    row: dict = {}
    for mode in ("off", "on"):
        outs = build()
        before, t0 = workload.prefill_tokens(client), time.perf_counter()
        if mode == "on":
            with kvs.stateflow():
                res = dask.compute(*outs)
        else:
            res = dask.compute(*outs)
        row[mode] = {
            "tokens": workload.prefill_tokens(client) - before,
            "wall": time.perf_counter() - t0,
            "ids": [r.token_ids for r in res],
        }
    row["calls"] = len(outs)
    row["states"] = len(kvs.explain(*build()).plan.states)
    return row


def table(rows: dict) -> str:
    """The shapes of :func:`command` as a text table, a line each."""
    lines = [
        f"{'shape':>16} | calls | states | prefill tokens off -> on | wall off -> on     | identical",
        "-" * 86,
    ]
    for name, r in rows.items():
        same = "yes" if r["off"]["ids"] == r["on"]["ids"] else "NO"
        lines.append(
            f"{name:>16} | {r['calls']:>5} | {r['states']:>6} | {r['off']['tokens']:>8} -> {r['on']['tokens']:<6} "
            f"({r['off']['tokens'] / max(r['on']['tokens'], 1):.2f}x) | "
            f"{r['off']['wall']:.2f} s -> {r['on']['wall']:.2f} s | {same}"
        )
    return "\n".join(lines)


def command(opts: Options) -> dict:
    """Every shape, each on a fresh two-worker cluster; prints :func:`table`."""
    rows = {}
    for name, build in progress.bar(shapes.SHAPES.items(), total=len(shapes.SHAPES), desc="shapes", unit="shape"):
        with (
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
            Client(cluster) as client,
        ):
            kvs.install(client, opts.model, torch_threads=1)
            progress.write(f"{name} ...")
            rows[name] = measure(client, build)
    print(table(rows))
    return rows
