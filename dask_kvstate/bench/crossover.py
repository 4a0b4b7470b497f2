"""Transfer versus recompute, measured: emulated link speed x context length; KV pull throughput.

For every cell of :func:`sweep` the worker that needs a state held elsewhere asks the
rule (its live measurements: pull bandwidth and latency per peer, prefill cost of its
model), then both options are really carried out and timed (:func:`sweep_cell`). The
rule is right when it picked the faster of the two measured times. :func:`throughput`
sets a KV pull beside a raw Dask transfer of a numpy array of the same bytes, on the
same link, in the same run. ``python -m dask_kvstate.bench crossover-sweep``
(:mod:`~dask_kvstate.bench.crossover_sweep`, ``examples/crossover.py``) runs both; the
bench's experiment 3 and the asv suite ``transfer_or_recompute`` call the same functions.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Iterator

import dask
import numpy as np
from distributed import Client, LocalCluster, wait

import dask_kvstate as kvs
from dask_kvstate import config, progress, tasks
from dask_kvstate.bench import probes, workload
from dask_kvstate.protocol import WORKER_PLUGIN

BANDWIDTHS = ["10 Mbit/s", "100 Mbit/s", "1 Gbit/s", "10 Gbit/s"]
CONTEXTS = [256, 512, 1024, 2048, 4096]
WORDS = [
    "the",
    "planner",
    "writes",
    "a",
    "plan",
    "and",
    "the",
    "developer",
    "writes",
    "code",
    "while",
    "the",
    "tester",
    "runs",
    "every",
    "test",
]


def context(tokens_hint: int, salt: str) -> str:
    """About ``tokens_hint`` tokens of text, unique to ``salt``.

    About one token per word for tiny-llama's and SmolLM2's tokenizers; salted so no
    cell reuses another's blocks.

    >>> context(3, "cell")
    'cell the planner writes'
    """
    return salt + " " + " ".join(WORDS[i % len(WORDS)] for i in range(tokens_hint))


def option_times(client, ref, b: str, repeats: int) -> dict[str, float]:
    """Median seconds of filling ``ref`` on worker ``b`` by each option: ``{"pull": s, "recompute": s}``."""
    times = {}
    for action in ("pull", "recompute"):
        runs = [
            client.submit(probes.measure_fill, ref, action, workers=[b], pure=False).result() for _ in range(repeats)
        ]
        times[action] = statistics.median(runs)
    return times


def sweep_cell(client, a, b, tokens_hint: int, salt: str, repeats: int) -> dict:
    """A state materialized on ``a``, needed on ``b``: the rule's choice vs both options timed there."""
    ref = client.submit(tasks.materialize, context(tokens_hint, salt), workers=[a], pure=False).result()
    est = client.submit(probes.estimate, ref, workers=[b], pure=False).result()
    times = option_times(client, ref, b, repeats)
    faster = min(times, key=times.__getitem__)
    return {
        "tokens": ref.num_tokens,
        "mib": ref.nbytes / 2**20,
        "choice": est["action"],
        "faster": faster,
        "t_pull": times["pull"],
        "t_recompute": times["recompute"],
        "est_pull": est["t_transfer"],
        "est_recompute": est["t_recompute"],
        "right": est["action"] == faster,
    }


def _holder_settings(client, holder: str, **changes) -> None:
    """Change the holder's worker settings (``zero_copy``, ``checksum``) for the pulls that follow."""

    def change(dask_worker, changes=changes):
        import dataclasses

        plugin = dask_worker.plugins[WORKER_PLUGIN]
        plugin.worker_settings = dataclasses.replace(plugin.worker_settings, **changes)

    client.run(change, workers=[holder])


def throughput(client, a, b, nbytes: int, repeats: int = 9, packed: bool = False, checksum: bool = False) -> dict:
    """KV pull vs Dask's own fetch of a numpy array of the same bytes, a -> b, interleaved.

    Both are timed inside a task on ``b``, from request to data in hand (the KV pull
    also checks and stores the blocks), so neither pays the scheduler's round trips.
    Random bytes, like KV, in case comm compression is on. Medians of ``repeats``. With
    ``packed``, each repeat also pulls with the holder's zero-copy path off
    (``packed_s``): the block arena's gain, measured beside it. With ``checksum``, each
    repeat pulls once with the holder's frame checksums off and once on
    (``unchecked_s``, ``checked_s``), in alternating order: what
    ``kvstate.transport.checksum`` costs, measured side by side.
    """
    per_token = workload.kv_bytes_per_token(client)
    ref = client.submit(tasks.materialize, context(nbytes // per_token, "throughput"), workers=[a], pure=False).result()
    arr = client.submit(
        lambda n: np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8), ref.nbytes, workers=[a], pure=False
    )
    wait(arr)

    def pull() -> float:
        return client.submit(probes.measure_fill, ref, "pull", workers=[b], pure=False).result()

    kv, raw, kv_packed = [], [], []
    checked: dict[bool, list[float]] = {False: [], True: []}
    for i in range(repeats):
        # alternate which goes first: the first transfer of a repeat may find colder caches
        if i % 2:
            raw.append(client.submit(probes.measure_raw_fetch, arr.key, a, workers=[b], pure=False).result())
        kv.append(pull())
        if not i % 2:
            raw.append(client.submit(probes.measure_raw_fetch, arr.key, a, workers=[b], pure=False).result())
        if packed:
            _holder_settings(client, a, zero_copy=False)
            kv_packed.append(pull())
            _holder_settings(client, a, zero_copy=True)
        if checksum:
            for on in (bool(i % 2), not i % 2):
                _holder_settings(client, a, checksum=on)
                checked[on].append(pull())
            _holder_settings(client, a, checksum=bool(config.get("transport.checksum")))
    kv_s, raw_s = statistics.median(kv), statistics.median(raw)
    out = {
        "mib": ref.nbytes / 2**20,
        "blocks": len(ref.blocks),
        "kv_s": kv_s,
        "raw_s": raw_s,
        "ratio": raw_s / kv_s,
        # each repeat's pull and fetch ran back to back, so their ratio sees one load: on a
        # shared machine the median of these drifts less than the ratio of the medians
        "paired_ratio": statistics.median(r / k for r, k in zip(raw, kv)),
    }
    if packed:
        out.update(
            packed_s=statistics.median(kv_packed),
            packed_ratio=raw_s / statistics.median(kv_packed),
            packed_paired_ratio=statistics.median(r / k for r, k in zip(raw, kv_packed)),
        )
    if checksum:
        out.update(
            unchecked_s=statistics.median(checked[False]),
            checked_s=statistics.median(checked[True]),
            # throughput lost to the checksums: 1 - checked rate / unchecked rate, per repeat
            checksum_cost=statistics.median(1 - u / c for u, c in zip(checked[False], checked[True])),
        )
    return out


def sweep(model: str, protocol: str, repeats: int) -> list[dict]:
    """Every cell of ``BANDWIDTHS`` x ``CONTEXTS``, one fresh two-worker cluster per bandwidth; prints each cell."""
    cells = []
    bar = progress.bar(total=len(BANDWIDTHS) * len(CONTEXTS), desc="crossover sweep", unit="cell")
    for bw in BANDWIDTHS:
        cfg = {"kvstate.transport.emulated-bandwidth": bw}
        with dask.config.set(cfg), two_workers(protocol) as client:
            kvs.install(client, model, torch_threads=1)
            a, b = sorted(client.nthreads())
            for n in CONTEXTS:
                cell = sweep_cell(client, a, b, n, f"{bw} {n}", repeats)
                cells.append({"bandwidth": bw, **cell})
                bar.update()
                progress.write(
                    f"{bw:>11} {cell['tokens']:>5} tok {cell['mib']:7.2f} MiB | rule: {cell['choice']:<9} "
                    f"(est pull {cell['est_pull']:.4f} s, recompute {cell['est_recompute']:.4f} s) | "
                    f"measured pull {cell['t_pull']:.4f} s, recompute {cell['t_recompute']:.4f} s | "
                    f"{'right' if cell['right'] else 'WRONG'}"
                )
    bar.close()
    right = sum(c["right"] for c in cells)
    print(f"rule picked the faster option in {right}/{len(cells)} cells ({100 * right / len(cells):.0f}%)")
    return cells


def throughputs(
    model: str, protocols: list[str], mib: int, repeats: int = 9, packed: bool = False, checksum: bool = False
) -> dict:
    """:func:`throughput` of ``mib`` MiB on a fresh two-worker cluster per comm; prints each result."""
    rates = {}
    for protocol in protocols:
        with two_workers(protocol) as client:
            kvs.install(client, model, torch_threads=1)
            a, b = sorted(client.nthreads())
            tp = rates[protocol] = throughput(client, a, b, mib * 2**20, repeats, packed=packed, checksum=checksum)
        print(
            f"{protocol} throughput, {tp['mib']:.0f} MiB in {tp['blocks']} blocks: "
            f"KV pull {tp['mib'] / tp['kv_s']:.0f} MiB/s, "
            f"Dask's fetch of a numpy array of the same bytes {tp['mib'] / tp['raw_s']:.0f} MiB/s: "
            f"KV at {100 * tp['ratio']:.0f}% of raw (paired {100 * tp['paired_ratio']:.0f}%)",
            flush=True,
        )
        if packed:
            print(
                f"{protocol} same run, zero-copy off (packed into a reply buffer): KV pull "
                f"{tp['mib'] / tp['packed_s']:.0f} MiB/s, {100 * tp['packed_ratio']:.0f}% of raw "
                f"(paired {100 * tp['packed_paired_ratio']:.0f}%)",
                flush=True,
            )
        if checksum:
            print(
                f"{protocol} same run, frame checksums off / on: KV pull {tp['mib'] / tp['unchecked_s']:.0f} / "
                f"{tp['mib'] / tp['checked_s']:.0f} MiB/s, checksums cost {100 * tp['checksum_cost']:.1f}% "
                "of pull throughput (median of paired repeats)",
                flush=True,
            )
    return rates


@contextlib.contextmanager
def two_workers(protocol: str) -> Iterator[Client]:
    """A client of a fresh two-process, one-thread-each ``LocalCluster`` on comm ``protocol`` (tcp, tls, ucx)."""
    if protocol == "ucx":  # UCX over loopback TCP and shared memory on a machine without RDMA/GPU
        os.environ.setdefault("UCX_TLS", "tcp,self,sm")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            protocol=f"{protocol}://",
            security=True if protocol == "tls" else None,
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client
