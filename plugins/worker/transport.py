"""Moving KV blocks between workers over the cluster's own comm (TCP, TLS or UCX): the puller.

A worker missing a state's blocks asks their holder's ``kvstate_get_blocks`` handler
(the holder's side is :mod:`dask_kvstate.plugins.worker.serve`). The blocks arrive as
raw frames, never pickles, and each received tensor is a view of its frame: no copy
on the way in. A malformed reply is a ValueError, and a frame that fails its checksum
(:mod:`~dask_kvstate.plugins.worker.checksum`) a ChecksumError; the caller treats
either like a failed pull (it recomputes).

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

from dask_kvstate.plugins.worker import checksum
from dask_kvstate.protocol import GET_BLOCKS


def _unruns(runs, step: int, limit: int, what: str) -> list[int]:
    """Inverse of :func:`dask_kvstate.plugins.worker.serve.runs` for a peer's runs, at most
    ``limit`` values; ValueError otherwise."""

    # lists or tuples: Dask's msgpack reads arrays back as tuples
    def ok(r) -> bool:
        return isinstance(r, (list, tuple)) and len(r) == 2 and all(type(x) is int for x in r) and r[0] >= 0 < r[1]

    if not isinstance(runs, (list, tuple)) or not all(ok(r) for r in runs):
        raise ValueError(f"peer sent a zero-copy reply with malformed {what} runs {runs!r:.200}")
    if sum(r[1] for r in runs) > limit:
        raise ValueError(f"peer sent a zero-copy reply with more {what} than the {limit} blocks asked for")
    return [v + step * k for v, n in runs for k in range(n)]


def _dtype(name: str):
    """A peer's dtype name, looked up in torch's namespace (never ``getattr``: a name
    from the wire must not reach torch's lazy module loader)."""
    import torch

    dtype = vars(torch).get(name) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"peer sent a block of unknown dtype {name!r}")
    return dtype


def _untail(resp: dict) -> dict:
    """A packed reply with its layout and missing hashes read from the frame's tail."""
    import msgpack
    import numpy as np

    frame = resp["frames"][0]
    arr = frame if isinstance(frame, np.ndarray) else np.frombuffer(frame, dtype=np.uint8)
    n = int(resp["tail"])
    if not 0 < n <= arr.nbytes:
        raise ValueError(f"peer sent a packed reply with a bad layout length {n}")
    meta = msgpack.unpackb(arr[arr.nbytes - n :].tobytes(), raw=False)
    return {**resp, "frames": [arr[: arr.nbytes - n]], "layout": meta["layout"], "missing": meta["missing"]}


def _frame_tensor(raw):
    """A received frame as a flat uint8 tensor sharing its memory (copied only if read-only)."""
    import numpy as np
    import torch

    arr = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=np.uint8)
    if not arr.flags.writeable:  # torch wants writable memory
        arr = arr.copy()
    return torch.from_numpy(arr.reshape(-1).view(np.uint8))


def _unpack_run(resp: dict, hashes: Sequence[bytes]) -> dict:
    """``hash -> tensor`` from a zero-copy reply (``serve.serve_run``): views of its frames, no copy.

    Block-major frames hold whole blocks back to back, in order; a layer-major reply is
    one frame, a joined ``[L, 2, H, P, D]`` tensor whose blocks are token slices.
    """
    import math

    layout, frames = resp["arena"], resp.get("frames")
    if not (
        isinstance(layout, (list, tuple))
        and len(layout) in (4, 5)
        and isinstance(frames, (list, tuple))
        and frames
        and (len(layout) == 4 or (layout[4] == "layer-major" and len(frames) == 1))
    ):
        raise ValueError(f"peer sent a malformed zero-copy reply: layout {layout!r:.200}")
    dtype_name, shape, token_runs, index_runs = layout[:4]
    layer_major = len(layout) == 5
    dtype = _dtype(dtype_name)
    if not (isinstance(shape, (list, tuple)) and len(shape) == 4 and all(type(x) is int and x > 0 for x in shape)):
        raise ValueError(f"peer sent a zero-copy reply with a bad block shape {shape!r:.200}")
    index = _unruns(index_runs, 1, len(hashes), "positions")
    tokens = _unruns(token_runs, 0, len(hashes), "token counts")
    if len(index) != len(tokens) or (index and (max(index) >= len(hashes) or len(set(index)) != len(index))):
        raise ValueError(
            f"peer sent a zero-copy reply whose {len(tokens)} blocks do not match positions "
            f"{index_runs!r:.200} of the {len(hashes)} blocks asked for"
        )
    flats = [_frame_tensor(f) for f in frames]
    per_token = math.prod(shape) * dtype.itemsize
    if sum(tokens) * per_token != sum(f.numel() for f in flats):
        raise ValueError(
            f"peer sent zero-copy frames of {sum(f.numel() for f in flats)} bytes for {sum(tokens)} tokens "
            f"of {per_token} bytes"
        )
    L, two, H, D = shape
    out, offset = {}, 0
    if layer_major:  # one joined [L, 2, H, P, D] tensor: its blocks are token slices of it
        joined = flats[0].view(dtype).view(L, two, H, sum(tokens), D)
        for i, t in zip(index, tokens):
            out[hashes[i]] = joined[:, :, :, offset : offset + t]
            offset += t
        return out
    frame = 0
    for i, t in zip(index, tokens):
        size = t * per_token
        if offset == flats[frame].numel() and frame + 1 < len(flats):
            frame, offset = frame + 1, 0
        if offset + size > flats[frame].numel():
            raise ValueError(f"peer sent a zero-copy frame that ends inside a block (frame {frame}, offset {offset})")
        out[hashes[i]] = flats[frame][offset : offset + size].view(dtype).view(L, two, H, t, D)
        offset += size
    return out


def unpack_blocks(resp: dict, hashes: Sequence[bytes] | None = None) -> dict:
    """``hash -> tensor`` from a reply of ``serve.serve_blocks``; each tensor is a view of its frame.

    ``hashes`` are the ones asked for: a zero-copy reply names its blocks by position
    in that request. A malformed reply raises ValueError (the caller recomputes).
    """
    import numpy as np
    import torch

    if "arena" in resp:
        if hashes is None:
            raise ValueError("a zero-copy reply names blocks by their position in the request: pass hashes")
        return _unpack_run(resp, hashes)
    if resp.get("tail"):  # packed: the layout trails the blocks in the one frame
        resp = _untail(resp)
    flats = []
    for raw in resp["frames"]:
        arr = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=np.uint8)
        if not arr.flags.writeable:  # torch wants writable memory
            arr = arr.copy()
        flats.append(torch.from_numpy(arr))
    return {
        h: flats[frame][offset : offset + size].view(_dtype(dtype)).reshape(shape)
        for h, dtype, shape, size, frame, offset in resp["layout"]
    }


@dataclass
class PullResult:
    """A holder's reply to one pull, as received; :meth:`blocks` checks and reads it.

    Checking (the checksums: a pass over every byte) is left to the caller's thread, so
    the event loop only carries the bytes.
    """

    reply: dict
    hashes: Sequence[bytes]  # the hashes asked for, in the order asked
    nbytes: int  # bytes of the reply's frames
    seconds: float  # from request to reply in hand

    @property
    def zero_copy(self) -> bool:
        """Whether the holder sent one run of its memory (no packing copy)."""
        return "arena" in self.reply

    def blocks(self) -> dict:
        """``hash -> tensor``, each a view of a received frame. Raises
        :class:`~dask_kvstate.plugins.worker.checksum.ChecksumError` for a frame damaged on
        the way, ValueError for a malformed reply: either way, nothing of it may be used."""
        checksum.verify(self.reply)
        return unpack_blocks(self.reply, self.hashes)


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


async def pull_blocks(
    pool,
    address: str,
    hashes: Sequence[bytes],
    *,
    connect_timeout: float,
    timeout: float,
    emulated_bandwidth: float | None = None,
) -> PullResult:
    """Ask the worker at ``address`` for ``hashes``; raises OSError/TimeoutError on failure.

    Blocks the holder no longer has are simply absent from the result. With
    ``emulated_bandwidth`` (bytes/s) the pull takes at least ``bytes / bandwidth``: an
    emulated slow link, so the transfer/recompute crossover shows on one machine.
    """
    t0 = time.perf_counter()
    hashes = list(hashes)
    resp = await call(pool, address, GET_BLOCKS, connect_timeout=connect_timeout, timeout=timeout, hashes=hashes)
    if not isinstance(resp, dict) or not isinstance(resp.get("frames"), (list, tuple)):
        raise ValueError(f"peer sent a malformed block reply {resp!r:.200}")
    nbytes = checksum.nbytes(resp["frames"])
    if emulated_bandwidth:
        await asyncio.sleep(max(0.0, nbytes / emulated_bandwidth - (time.perf_counter() - t0)))
    return PullResult(resp, hashes, nbytes, time.perf_counter() - t0)


async def pull_within(
    patience: float, on_late, pool, address: str, hashes: Sequence[bytes], **kwargs
) -> PullResult | None:
    """:func:`pull_blocks`, waited for ``patience`` seconds at most; ``None`` when cut off.

    A pull cut off is not cancelled: it finishes in the background (within its own
    ``timeout``) and ``on_late`` gets its task, so the puller can time the link it was
    too slow on. Its blocks are not used.
    """
    task = asyncio.ensure_future(pull_blocks(pool, address, hashes, **kwargs))
    done, _ = await asyncio.wait({task}, timeout=max(patience, 0.0))
    if task in done:
        return task.result()
    task.add_done_callback(on_late)
    return None


async def pull_beside(
    patience: float, on_late, pool, address: str, hashes: Sequence[bytes], ahead: Sequence[bytes], **kwargs
) -> tuple[PullResult | None, asyncio.Task]:
    """:func:`pull_within` of ``hashes``, with a pull of ``ahead`` asked for at once beside it.

    The two share the link, so the second costs no round trip of its own once the
    first says to go on (:func:`wait_pull`); it is cancelled here when the first was
    cut off or failed, and by the caller when the first says not to go on.
    """
    first = asyncio.ensure_future(pull_blocks(pool, address, hashes, **kwargs))
    second = asyncio.ensure_future(pull_blocks(pool, address, ahead, **kwargs))
    second.add_done_callback(_retrieved)
    done, _ = await asyncio.wait({first}, timeout=max(patience, 0.0))
    if first not in done:
        first.add_done_callback(on_late)
        second.cancel()
        return None, second
    if first.exception() is not None:
        second.cancel()
    return first.result(), second


def _retrieved(task: asyncio.Task) -> None:
    """Read a dropped pull's outcome, so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


async def wait_pull(task: asyncio.Task, patience: float) -> PullResult | None:
    """A pull started before (:func:`pull_beside`), waited for ``patience`` more seconds
    at most; ``None`` when cut off (then it is cancelled: its comm is aborted)."""
    done, _ = await asyncio.wait({task}, timeout=max(patience, 0.0))
    if task in done:
        return task.result()
    task.cancel()
    return None
