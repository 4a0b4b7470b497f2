"""Moving KV blocks between workers over the cluster's own comm (TCP, TLS or UCX).

The holder serves blocks from a worker RPC handler (``kvstate_get_blocks``); each tensor
goes out as a uint8 view of its memory wrapped in ``to_serialize``, so Dask sends the
buffer as its own frame: no pickling, no copy on the way out (CUDA blocks are staged
through host memory), and on the way in the tensor is a view of the received frame.

The puller gives a holder ``transport.connect-timeout`` to answer: a dead holder must
cost seconds, not the 30 s default of ``distributed.comm.timeouts.connect``, because
the caller falls back to recomputing the blocks.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from distributed.core import send_recv
from distributed.protocol import to_serialize

HANDLER = "kvstate_get_blocks"


def _frame(t) -> tuple:
    """A tensor as (zero-copy uint8 frame, dtype name, shape).

    Raw bytes rather than Dask's torch serializer, which goes through ``.numpy()`` and
    so refuses bfloat16 and CUDA tensors; CUDA blocks are staged through host memory.
    """
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.nelement() else memoryview(b"")
    return to_serialize(raw), str(t.dtype).removeprefix("torch."), list(t.shape)


def _tensor(raw, dtype: str, shape: list):
    import numpy as np
    import torch

    arr = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    if not arr.flags.writeable:  # torch wants writable memory; frames read off TCP usually are
        arr = arr.copy()
    return torch.from_numpy(arr).view(getattr(torch, dtype)).reshape(shape)


def serve_blocks(store, hashes: Sequence[bytes]) -> dict:
    """The handler's reply: the present blocks as zero-copy frames, and the missing hashes."""
    found, frames, dtypes, shapes, missing = [], [], [], [], []
    for h in hashes:
        t = store.peek(h) if store is not None else None
        if t is None:
            missing.append(h)
            continue
        frame, dtype, shape = _frame(t)
        found.append(h)
        frames.append(frame)
        dtypes.append(dtype)
        shapes.append(shape)
    return {"status": "OK", "hashes": found, "tensors": frames, "dtypes": dtypes, "shapes": shapes,
            "missing": missing}  # fmt: skip


@dataclass
class PullResult:
    blocks: dict[bytes, object]  # hash -> tensor
    nbytes: int
    seconds: float


async def call(pool, address: str, op: str, *, connect_timeout: float, timeout: float, **msg):
    """One RPC to a peer worker with our own connect and reply timeouts.

    ``pool.connect`` retries a refused connection until its timeout, so a dead peer
    costs ``connect_timeout`` rather than Dask's default 30 s.
    """
    comm = await pool.connect(address, timeout=connect_timeout)
    try:
        return await asyncio.wait_for(send_recv(comm, op=op, **msg), timeout)
    except BaseException:
        comm.abort()
        raise
    finally:
        pool.reuse(address, comm)


async def pull_blocks(pool, address: str, hashes: Sequence[bytes], *, connect_timeout: float, timeout: float,
                      emulated_bandwidth: float | None = None) -> PullResult:  # fmt: skip
    """Fetch ``hashes`` from the worker at ``address``; raises OSError/TimeoutError on failure.

    Blocks the holder no longer has are simply absent from the result. With
    ``emulated_bandwidth`` (bytes/s) the pull takes at least ``bytes / bandwidth``: an
    emulated slow link, so the transfer/recompute crossover shows on one machine.
    """
    t0 = time.perf_counter()
    resp = await call(pool, address, HANDLER, connect_timeout=connect_timeout, timeout=timeout, hashes=list(hashes))
    blocks = {h: _tensor(raw, d, shape) for h, raw, d, shape in
              zip(resp["hashes"], resp["tensors"], resp["dtypes"], resp["shapes"])}  # fmt: skip
    nbytes = sum(t.nelement() * t.element_size() for t in blocks.values())
    if emulated_bandwidth:
        await asyncio.sleep(max(0.0, nbytes / emulated_bandwidth - (time.perf_counter() - t0)))
    return PullResult(blocks, nbytes, time.perf_counter() - t0)
