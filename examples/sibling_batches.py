"""Where the 16-agent run's time goes on the bench's cluster, per sibling batch, for several batch sizes.

Runs the bench's kvstate workload (k agents over one shared context, Y new tokens)
on 2 workers x 1 thread, once per ``--batch`` value, alternating, in one cluster, and
prints per run: the wall time, each batch's time to first token (its state resolve,
pull included, plus its suffix prefill), its suffix prefill and its decode, and the
CPU seconds each worker process used. ``--batch 8,16,8,16`` compares two batches of 8
(one per worker) with one batch of 16 on the holder.

Run: ``python examples/sibling_batches.py [--model smollm2-135m] [--tokens 4096] [--agents 16] [--batch 8,16]``.
"""

from __future__ import annotations

import argparse
import time

import dask
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.bench import workload


def _cpu_seconds(dask_worker=None) -> float:
    import psutil

    t = psutil.Process().cpu_times()
    return t.user + t.system


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4096, help="shared context length")
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", default="8,16", help="comma-separated kvstate.compiler.batch-siblings values")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch.split(",")]
    out = []
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        kvs.install(client, args.model, torch_threads=1)
        client.run(workload.warm_up)
        ctx = workload.contexts(client, [args.tokens])[args.tokens]
        for size in sizes:
            workload.settle(client)
            cpu0 = client.run(_cpu_seconds)
            outs = workload.build("kvstate", ctx, args.agents, args.new_tokens)
            with kvs.stateflow(), dask.config.set({"kvstate.compiler.batch-siblings": size}):
                t0 = time.perf_counter()
                results = client.gather(client.compute(outs))
                wall = time.perf_counter() - t0
            cpu1 = client.run(_cpu_seconds)
            batches = {}
            for g in results:
                batches.setdefault(
                    g.batch_id,
                    {
                        "rows": g.batch_rows,
                        "ttft_s": g.ttft,
                        "prefill_s": g.prefill_s * g.batch_rows,
                        "decode_s": g.decode_s,
                    },
                )
            row = {
                "batch_siblings": size,
                "wall_s": wall,
                "batches": list(batches.values()),
                "worker_cpu_s": sorted(cpu1[w] - cpu0[w] for w in cpu0),
            }
            out.append(row)
            print(
                f"batch-siblings {size}: wall {wall:.2f} s; worker CPU "
                f"{', '.join(f'{c:.1f}' for c in row['worker_cpu_s'])} s; batches (rows, ttft, prefill, decode s): "
                + "; ".join(
                    f"{b['rows']}, {b['ttft_s']:.2f}, {b['prefill_s']:.2f}, {b['decode_s']:.2f}" for b in row["batches"]
                )
            )
    return out


if __name__ == "__main__":
    main()
