"""Where the k-agent run's time goes on the bench's cluster, per sibling batch, for several batch sizes.

Runs the bench's kvstate workload (:mod:`dask_kvstate.bench.workload`: k agents over
one shared context, Y new tokens) on 2 workers x 1 thread, once per batch size of
``batch``, in that order, in one cluster, and prints per run: the wall time, each
batch's time to first token (its state resolve, pull included, plus its suffix
prefill), its suffix prefill and its decode, and the CPU seconds each worker process
used. Repeating sizes alternates them, so a drift in the machine's load hits both.
``python -m dask_kvstate.bench sibling-batches`` (``examples/sibling_batches.py``) runs
:func:`command`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import dask
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.bench import workload


@dataclass
class Options:
    """The workload's size and the batch sizes to compare."""

    model: str = field(default="smollm2-135m", metadata={"help": "the model the two workers install"})
    tokens: int = field(default=4096, metadata={"help": "shared context length"})
    agents: int = field(default=16, metadata={"help": "agents resuming from the shared context"})
    new_tokens: int = field(default=64, metadata={"help": "tokens each agent generates"})
    batch: str = field(
        default="8,16", metadata={"help": "comma-separated kvstate.compiler.batch-siblings values, run in turn"}
    )


def _cpu_seconds(dask_worker=None) -> float:
    import psutil

    t = psutil.Process().cpu_times()
    return t.user + t.system


def one_run(client: Client, context: str, agents: int, new_tokens: int, size: int) -> dict:
    """The kvstate workload with ``batch-siblings`` at ``size``: wall time, per-batch times, worker CPU seconds."""
    workload.settle(client)
    cpu0 = client.run(_cpu_seconds)
    outs = workload.build("kvstate", context, agents, new_tokens)
    with kvs.stateflow(), dask.config.set({"kvstate.compiler.batch-siblings": size}):
        t0 = time.perf_counter()
        results = client.gather(client.compute(outs))
        wall = time.perf_counter() - t0
    cpu1 = client.run(_cpu_seconds)
    batches: dict = {}
    for g in results:
        batches.setdefault(
            g.batch_id,
            {"rows": g.batch_rows, "ttft_s": g.ttft, "prefill_s": g.prefill_s * g.batch_rows, "decode_s": g.decode_s},
        )
    return {
        "batch_siblings": size,
        "wall_s": wall,
        "batches": list(batches.values()),
        "worker_cpu_s": sorted(cpu1[w] - cpu0[w] for w in cpu0),
    }


def line(row: dict) -> str:
    """One run of :func:`one_run` as a line."""
    return (
        f"batch-siblings {row['batch_siblings']}: wall {row['wall_s']:.2f} s; worker CPU "
        f"{', '.join(f'{c:.1f}' for c in row['worker_cpu_s'])} s; batches (rows, ttft, prefill, decode s): "
        + "; ".join(
            f"{b['rows']}, {b['ttft_s']:.2f}, {b['prefill_s']:.2f}, {b['decode_s']:.2f}" for b in row["batches"]
        )
    )


def command(opts: Options) -> list[dict]:
    """One cluster, one shared context, :func:`one_run` per batch size; prints a line each."""
    sizes = [int(b) for b in opts.batch.split(",")]
    out = []
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        kvs.install(client, opts.model, torch_threads=1)
        client.run(workload.warm_up)
        context = workload.contexts(client, [opts.tokens])[opts.tokens]
        for size in sizes:
            row = one_run(client, context, opts.agents, opts.new_tokens, size)
            out.append(row)
            print(line(row))
    return out
