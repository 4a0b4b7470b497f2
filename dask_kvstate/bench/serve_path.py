"""The holder's serve path and the wire, in isolation: packing copy vs block arena.

Three measurements, each a median of ``repeats``, both sides interleaved:

* :func:`serve`: the handler's work for a pull of SmolLM2-135M-shaped blocks (30
  layers, 3 KV heads, head dim 64, float32, 64-token blocks) in one process: packing
  them into a warm reply buffer (``serve_blocks`` with the zero-copy path off) against
  finding the arena run (``serve_run``); and the puller's work on a reply already read
  (``unpack_blocks`` plus the store inserts).
* :func:`wire`: a worker RPC between two processes replying with the arena's memory,
  its small layout either in the message or as a second frame (which one the zero-copy
  reply should use), beside Dask's ``get_data`` of a numpy array of the same bytes.

Worker-side code and torch are imported inside the functions, so importing this
module stays as light as the core. ``python -m dask_kvstate.bench serve-path``
(``examples/serve_path.py``) runs :func:`command`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 64  # SmolLM2-135M


def smollm2_blocks(mib: int):
    """(block hashes, blocks laid out in one arena) for ``mib`` MiB of random SmolLM2-shaped KV."""
    import torch

    from dask_kvstate.plugins.worker.arena import lay_out

    tokens = mib * 2**20 // (LAYERS * 2 * KV_HEADS * HEAD_DIM * 4)
    kv = torch.randn(LAYERS, 2, KV_HEADS, tokens, HEAD_DIM)
    hashes = [i.to_bytes(16, "little") for i in range(-(-tokens // BLOCK))]
    return hashes, lay_out(kv, BLOCK)


def median_ms(fn, repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``fn``, in milliseconds, after one untimed warm call."""
    fn()  # warm: buffers allocated, pages touched
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _filled_store(hashes, blocks):
    from dask_kvstate.plugins.worker.block_store import TieredBlockStore

    store = TieredBlockStore(device_bytes=2**31, host_bytes=2**31, disk_bytes=2**31, device="cpu")
    for h, t in zip(hashes, blocks):
        store.put(h, t)
    return store


def serve(mib: int, repeats: int) -> dict:
    """Packing copy vs zero-copy run on the holder, and unpack + inserts on the puller, in ms."""
    from dask_kvstate.plugins.worker.block_store import TieredBlockStore
    from dask_kvstate.plugins.worker.packing import PackingBuffers
    from dask_kvstate.plugins.worker.serve import serve_blocks, serve_run
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    hashes, blocks = smollm2_blocks(mib)
    store = _filled_store(hashes, blocks)
    buffers = PackingBuffers(keep_bytes=2 * mib * 2**20)

    def pack():
        reply = serve_blocks(store, hashes, buffers, zero_copy=False)
        buffers.release(reply["frames"][0].data)  # as the comm does once it has written the reply

    packed = median_ms(pack, repeats)
    run = median_ms(lambda: serve_run(store, hashes), repeats)
    reply = serve_run(store, hashes)
    assert reply is not None, "blocks laid out by lay_out and put in order are one run of memory"
    frame = bytearray(reply["frames"][0].data.tobytes())  # as a comm would hand it over

    into = TieredBlockStore(device_bytes=2**31, host_bytes=2**31, disk_bytes=2**31, device="cpu")
    times = []
    for _ in range(repeats + 1):
        into.discard(hashes)
        t0 = time.perf_counter()
        for h, t in unpack_blocks({**reply, "frames": [frame]}, hashes).items():
            into.put(h, t)
        times.append(time.perf_counter() - t0)
    got = 1e3 * statistics.median(times[1:])
    into.close()
    store.close()
    return {"blocks": len(hashes), "pack_ms": packed, "zero_copy_ms": run, "receive_ms": got}


def wire(mib: int, repeats: int) -> dict:
    """Reply with the arena's memory, layout in the message vs as a second small frame."""
    import numpy as np
    from distributed import Client, LocalCluster
    from distributed.protocol import to_serialize

    from dask_kvstate.plugins.worker.serve import serve_run

    def install(dask_worker, mib=mib):
        hashes, blocks = smollm2_blocks(mib)
        store = _filled_store(hashes, blocks)
        reply = serve_run(store, hashes)
        assert reply is not None, "blocks laid out by lay_out and put in order are one run of memory"
        meta = np.frombuffer(repr(reply["arena"]).encode(), dtype=np.uint8)

        async def in_message(comm=None):
            return reply

        async def own_frame(comm=None):
            return {"status": "OK", "frames": [reply["frames"][0], to_serialize(meta)]}

        dask_worker.handlers["bench_in_message"] = in_message
        dask_worker.handlers["bench_own_frame"] = own_frame
        dask_worker._bench_keep = store
        return len(hashes)

    def fetch(holder, op, repeats=repeats):
        from distributed import get_worker
        from distributed.utils import sync

        w = get_worker()

        async def once():
            t0 = time.perf_counter()
            await getattr(w.rpc(holder), op)()
            return time.perf_counter() - t0

        return [sync(w.loop, once) for _ in range(repeats)]

    def raw(key, holder):
        from dask_kvstate.bench.probes import measure_raw_fetch

        return [measure_raw_fetch(key, holder)]

    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        a, b = sorted(client.nthreads())
        client.run(install, workers=[a])
        nbytes = client.run(lambda dask_worker: dask_worker._bench_keep.nbytes, workers=[a])[a]
        arr = client.submit(
            lambda n: np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8), nbytes, workers=[a], pure=False
        )
        arr.result()
        times: dict[str, list[float]] = {"in_message": [], "own_frame": [], "dask_fetch": []}
        for _ in range(repeats):  # interleaved, so all see the same load
            for op in ("in_message", "own_frame"):
                times[op] += client.submit(fetch, a, f"bench_{op}", 1, workers=[b], pure=False).result()
            times["dask_fetch"] += client.submit(raw, arr.key, a, workers=[b], pure=False).result()
    return {op: 1e3 * statistics.median(ts[1:] or ts) for op, ts in times.items()}


def run(mib: int = 64, repeats: int = 25, *, with_wire: bool = False, torch_threads: int = 1) -> dict:
    """:func:`serve` (and :func:`wire` with ``with_wire``) of ``mib`` MiB, each result printed as it comes."""
    import torch

    # A multi-threaded copy on cores other jobs share stalls on the slowest thread
    # (64 MiB took 100-500 ms with 2 threads under load, 20 ms with one).
    torch.set_num_threads(torch_threads)
    out = serve(mib, repeats)
    print(
        f"serve {mib} MiB in {out['blocks']} blocks: packing copy {out['pack_ms']:.2f} ms, zero-copy run "
        f"{out['zero_copy_ms']:.3f} ms; receive (unpack + store inserts) {out['receive_ms']:.3f} ms",
        flush=True,
    )
    if with_wire:
        out["wire"] = w = wire(mib, repeats)
        print(
            f"wire {mib} MiB zero-copy reply: layout in the message {w['in_message']:.1f} ms, "
            f"as its own frame {w['own_frame']:.1f} ms; Dask's fetch of a numpy array of the same bytes "
            f"{w['dask_fetch']:.1f} ms",
            flush=True,
        )
    return out


@dataclass
class Options:
    """The measurement's size and repeats, and whether the two-process wire runs too."""

    mib: int = field(default=64, metadata={"help": "MiB of KV blocks served per measurement"})
    repeats: int = field(default=25, metadata={"help": "timings per side; the medians are reported"})
    wire: bool = field(default=False, metadata={"help": "also time the two reply shapes between two processes"})
    torch_threads: int = field(
        default=1, metadata={"help": "torch threads, as the workers run them (kvs.install(torch_threads=1))"}
    )


def command(opts: Options) -> dict:
    """:func:`run` with ``opts``."""
    return run(opts.mib, opts.repeats, with_wire=opts.wire, torch_threads=opts.torch_threads)
