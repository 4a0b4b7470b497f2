"""Transfer versus recompute, measured: emulated link speed x context length.

For every cell the worker that needs a state held elsewhere asks the rule (its live
measurements: pull bandwidth and latency per peer, prefill cost of its model), then
both options are really carried out and timed. The rule is right when it picked the
faster of the two measured times. Also measures KV pull throughput against a raw Dask
transfer of a numpy array of the same bytes, on the same link, in the same run.

Run: ``python examples/crossover.py [--model tiny-llama] [--protocol tcp]``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import dask
import numpy as np
from distributed import Client, LocalCluster, wait

import dask_kvstate as kvs
from dask_kvstate import progress, tasks

BANDWIDTHS = ["10 Mbit/s", "100 Mbit/s", "1 Gbit/s", "10 Gbit/s"]
CONTEXTS = [256, 512, 1024, 2048, 4096]
WORDS = "the planner writes a plan and the developer writes code while the tester runs every test".split()


def context(tokens_hint: int, salt: str) -> str:
    # About one token per word for tiny-llama's and SmolLM2's tokenizers; salted so no
    # cell reuses another's blocks.
    return salt + " " + " ".join(WORDS[i % len(WORDS)] for i in range(tokens_hint))


def sweep_cell(client, a, b, tokens_hint: int, salt: str, repeats: int) -> dict:
    ref = client.submit(tasks.materialize, context(tokens_hint, salt), workers=[a], pure=False).result()
    est = client.submit(tasks.estimate, ref, workers=[b], pure=False).result()
    times = {}
    for action in ("pull", "recompute"):
        runs = [client.submit(tasks.measure_fill, ref, action, workers=[b], pure=False).result() for _ in range(repeats)]
        times[action] = statistics.median(runs)
    faster = min(times, key=times.get)
    return {"tokens": ref.num_tokens, "mib": ref.nbytes / 2**20, "choice": est["action"], "faster": faster,
            "t_pull": times["pull"], "t_recompute": times["recompute"], "est_pull": est["t_transfer"],
            "est_recompute": est["t_recompute"], "right": est["action"] == faster}  # fmt: skip


def throughput(client, a, b, nbytes: int, repeats: int = 3) -> dict:
    """KV pull vs Dask's own transfer of a numpy array of the same size between the same workers."""
    tokens = nbytes // client.run(lambda dask_worker: dask_worker.plugins["kvstate"].runtime.backend.kv_bytes_per_token)[a]
    ref = client.submit(tasks.materialize, context(tokens, "throughput"), workers=[a], pure=False).result()
    kv = [client.submit(tasks.measure_fill, ref, "pull", workers=[b], pure=False).result() for _ in range(repeats)]
    raw = []
    for i in range(repeats):
        arr = client.submit(np.ones, ref.nbytes, dtype=np.uint8, workers=[a], pure=False, key=f"raw-{i}-{time.time()}")
        wait(arr)
        t0 = time.perf_counter()
        client.replicate([arr], workers=[b], n=2)
        raw.append(time.perf_counter() - t0)
        del arr
    return {"mib": ref.nbytes / 2**20, "kv_s": min(kv), "raw_s": min(raw), "ratio": min(raw) / min(kv)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    cells = []
    sweep = progress.bar(total=len(BANDWIDTHS) * len(CONTEXTS), desc="crossover sweep", unit="cell")
    for bw in BANDWIDTHS:
        cfg = {"kvstate.transport.emulated-bandwidth": bw}
        with dask.config.set(cfg), LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                                protocol=f"{args.protocol}://", dashboard_address=":0") as cluster:  # fmt: skip
            with Client(cluster) as client:
                kvs.install(client, args.model, torch_threads=1)
                a, b = sorted(client.scheduler_info()["workers"])
                for n in CONTEXTS:
                    cell = sweep_cell(client, a, b, n, f"{bw} {n}", args.repeats)
                    cells.append({"bandwidth": bw, **cell})
                    sweep.update()
                    progress.write(f"{bw:>11} {cell['tokens']:>5} tok {cell['mib']:7.2f} MiB | rule: {cell['choice']:<9} "
                          f"(est pull {cell['est_pull']:.4f} s, recompute {cell['est_recompute']:.4f} s) | measured "
                          f"pull {cell['t_pull']:.4f} s, recompute {cell['t_recompute']:.4f} s | "
                          f"{'right' if cell['right'] else 'WRONG'}")  # fmt: skip
    sweep.close()
    right = sum(c["right"] for c in cells)
    print(f"rule picked the faster option in {right}/{len(cells)} cells ({100 * right / len(cells):.0f}%)")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, protocol=f"{args.protocol}://",
                      dashboard_address=":0") as cluster, Client(cluster) as client:  # fmt: skip
        kvs.install(client, args.model, torch_threads=1)
        a, b = sorted(client.scheduler_info()["workers"])
        tp = throughput(client, a, b, 64 * 2**20)
    print(f"{args.protocol} throughput, {tp['mib']:.0f} MiB: KV pull {tp['mib'] / tp['kv_s']:.0f} MiB/s, raw Dask "
          f"numpy transfer {tp['mib'] / tp['raw_s']:.0f} MiB/s: KV at {100 * tp['ratio']:.0f}% of raw")  # fmt: skip
    return {"cells": cells, "throughput": tp}


if __name__ == "__main__":
    main()
