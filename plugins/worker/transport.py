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
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from distributed.core import send_recv
from distributed.protocol import to_serialize

from dask_kvstate.blocks import nbytes as tensor_bytes

HANDLER = "kvstate_get_blocks"


def _raw(t):
    """A tensor's bytes as a flat uint8 tensor (CUDA blocks staged through host memory)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous().reshape(-1).view(torch.uint8)


BIG_BLOCK = 1 << 20  # bytes: without a packing buffer, a block this large is its own frame
GROUP = 4 << 20  # bytes: without a packing buffer, smaller blocks share frames of about this size


class PackingBuffers:
    """Reply buffers a worker reuses to pack the blocks of one pull into one frame.

    Why one frame: Dask's TCP comm reads every separate buffer of a message with its own
    allocation and ``await``, and a pull of 21 blocks of 3 MiB took 66 ms against 43 ms
    for the same 64 MiB as one frame (loopback, 2 busy cores). Why reused buffers: a
    fresh 64 MiB allocation page-faults on the copy (50 ms against 43 ms), while a copy
    into warm memory is nearly free. A buffer is handed out again only once nothing
    references it (the comm has sent it); at most ``keep_bytes`` stay allocated.
    """

    def __init__(self, keep_bytes: int):
        self.keep_bytes = int(keep_bytes)
        self._buffers: list = []
        self._lock = threading.Lock()

    def take(self, nbytes: int):
        """A writable uint8 array of ``nbytes``: a view of an idle kept buffer, or new."""
        import numpy as np

        with self._lock:
            for buf in self._buffers:
                # references: the list, the loop variable, getrefcount's argument; a view
                # still queued on a comm holds one more through its ``.base``
                if buf.nbytes >= nbytes and sys.getrefcount(buf) <= 3:
                    return buf[:nbytes]
            buf = np.empty(nbytes, dtype=np.uint8)
            if sum(b.nbytes for b in self._buffers) + nbytes <= self.keep_bytes:
                self._buffers.append(buf)
            return buf[:nbytes] if buf.nbytes > nbytes else buf

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._buffers)


def serve_blocks(
    store, hashes: Sequence[bytes], buffers: PackingBuffers | None = None, *, zero_copy: bool = True
) -> dict:
    """The handler's reply: the present blocks as frames, and the missing hashes.

    First (unless ``zero_copy`` is False: the caller tried already) the present blocks
    go out as the one run of memory they may form (:func:`serve_run`), with no copy.
    With ``buffers``, a pull of up to ``buffers.keep_bytes`` travels as one frame, copied
    into a reused buffer (see :class:`PackingBuffers`). Otherwise a block of 1 MiB or
    more is its own frame, sent straight from its memory, and smaller blocks are packed
    a few MiB to a frame: thousands of 32 KiB frames spend their time in per-frame
    bookkeeping (measured: 14% of a raw Dask transfer of the same bytes). Raw bytes
    rather than Dask's torch serializer, which goes through ``.numpy()`` and refuses
    bfloat16 and CUDA tensors.
    """
    import msgpack
    import numpy as np
    import torch

    reply = serve_run(store, hashes) if zero_copy else None
    if reply is not None:
        return reply
    found, missing = [], []
    for h in hashes:
        t = store.peek(h) if store is not None else None
        if t is None:
            missing.append(h)
        else:
            found.append((h, str(t.dtype).removeprefix("torch."), list(t.shape), _raw(t)))
    total = sum(raw.numel() for *_, raw in found)
    frames, layout = [], []
    if buffers is not None and 0 < total <= buffers.keep_bytes:
        offset = 0
        for h, dtype, shape, raw in found:
            layout.append([h, dtype, shape, raw.numel(), 0, offset])
            offset += raw.numel()
        # The layout rides at the end of the frame, not in the message: a message header
        # of more than about 2 KiB in front of a large buffer cost 10-16 ms per 64 MiB
        # pull on Dask's TCP comm (measured with 1.4 KB of padding alone).
        meta = msgpack.packb({"layout": layout, "missing": missing}, use_bin_type=True)
        out = buffers.take(total + len(meta))
        dst = torch.from_numpy(out)
        for (*_, raw), row in zip(found, layout):
            dst[row[5] : row[5] + raw.numel()].copy_(raw)
        out[total:] = np.frombuffer(meta, dtype=np.uint8)
        return {"status": "OK", "frames": [to_serialize(out)], "tail": len(meta)}

    group, group_bytes = [], 0

    def flush():
        nonlocal group, group_bytes
        if group:
            frames.append(to_serialize((torch.cat(group) if len(group) > 1 else group[0]).numpy()))
            group, group_bytes = [], 0

    for h, dtype, shape, raw in found:
        meta = [h, dtype, shape, raw.numel()]
        if raw.numel() >= BIG_BLOCK:
            flush()
            frames.append(to_serialize(raw.numpy()))
            layout.append([*meta, len(frames) - 1, 0])
        else:
            layout.append([*meta, len(frames), group_bytes])  # the frame the group will become
            group.append(raw)
            group_bytes += raw.numel()
            if group_bytes >= GROUP:
                flush()
    flush()
    return {"status": "OK", "frames": frames, "layout": layout, "missing": missing}


def serve_run(store, hashes: Sequence[bytes]) -> dict | None:
    """The zero-copy reply, or None when the present blocks are not one run of memory.

    When every present block sits in a memory tier and together they are one run of
    one storage (a block arena, a frame received earlier, or all of a joined copy; see
    :mod:`dask_kvstate.plugins.worker.arena`), the frame is that memory itself: nothing is copied.
    The layout is small enough to ride in the message (dtype, the block shape without
    its token axis, and run-lengths of token counts and of request positions: a few
    dozen bytes), so it needs neither a tail in the frame nor a frame of its own.
    Otherwise None, and :func:`serve_blocks` packs. Never raises.
    """
    from dask_kvstate.plugins.worker.arena import span

    if store is None:
        return None
    tensors, index = [], []
    for i, h in enumerate(hashes):
        if store.where(h) is None:
            continue
        t = store.peek_memory(h)
        if t is None:  # on disk (or changing tier right now): pack from a fresh read
            return None
        tensors.append(t)
        index.append(i)
    if not tensors or not all(
        t.dim() == 5 and t.shape[:3] == tensors[0].shape[:3] and t.shape[4] == tensors[0].shape[4] for t in tensors
    ):
        return None
    run, order = span(tensors), []
    if run is None:
        run, order = _whole_joined(tensors), ["layer-major"]
    if run is None:
        return None
    L, two, H, _, D = tensors[0].shape
    tokens = _runs([int(t.shape[3]) for t in tensors], step=0)
    layout = [str(tensors[0].dtype).removeprefix("torch."), [L, two, H, D], tokens, _runs(index, step=1), *order]
    return {"status": "OK", "frames": [to_serialize(run.numpy())], "arena": layout}


def _whole_joined(tensors: Sequence):
    """The bytes of a whole joined state as one flat uint8 tensor, when ``tensors`` are its blocks.

    A holder that resumed a state *adopted* the joined copy: its blocks are token slices
    (views) of one ``[L, 2, H, P, D]`` tensor (layer-major), which :func:`span` does not
    see as one run. When the blocks asked for are all of that tensor, in order, its
    memory is still one run: sent as is, the receiver keeps it as the joined tensor, its
    blocks as the same views, and its own resume joins them without a copy either.
    Otherwise None. CPU only, as :func:`span`.
    """
    import torch

    from dask_kvstate.blocks import consecutive_view

    joined = consecutive_view(tensors)
    if joined is None or joined.device.type != "cpu" or not joined.is_contiguous():
        return None
    storage = joined.untyped_storage()
    if joined.storage_offset() != 0 or joined.numel() * joined.element_size() != storage.nbytes():
        return None  # part of a larger tensor: its bytes are not the blocks' alone
    return joined.reshape(-1).view(torch.uint8)


def _runs(values: Sequence[int], step: int) -> list[list[int]]:
    """Run-length code: ``[[first value, count], ...]`` of runs that grow by ``step``.

    Examples
    --------
    >>> _runs([64, 64, 64, 7], step=0), _runs([0, 1, 2, 5], step=1)
    ([[64, 3], [7, 1]], [[0, 3], [5, 1]])
    """
    out: list[list[int]] = []
    for v in values:
        if out and v == out[-1][0] + step * out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _unruns(runs, step: int, limit: int, what: str) -> list[int]:
    """Inverse of :func:`_runs` for a peer's runs, at most ``limit`` values; ValueError otherwise."""

    # lists or tuples: Dask's msgpack reads arrays back as tuples
    def ok(r) -> bool:
        return isinstance(r, (list, tuple)) and len(r) == 2 and all(type(x) is int for x in r) and r[0] >= 0 < r[1]

    if not isinstance(runs, (list, tuple)) or not all(ok(r) for r in runs):
        raise ValueError(f"peer sent a zero-copy reply with malformed {what} runs {runs!r:.200}")
    if sum(r[1] for r in runs) > limit:
        raise ValueError(f"peer sent a zero-copy reply with more {what} than the {limit} blocks asked for")
    return [v + step * k for v, n in runs for k in range(n)]


def serve_inline(store, hashes: Sequence[bytes], max_copy_bytes: int, packing: bool = True) -> bool:
    """Whether :func:`serve_blocks` is cheap enough for the event loop: every block in a
    memory tier (no disk read, no checksum) and at most ``max_copy_bytes`` to copy
    (all of them when ``packing`` into one frame, else the small ones)."""
    if store is None:
        return True
    copy = 0
    for h in hashes:
        tier = store.where(h)
        if tier == "disk":
            return False
        size = store.size_of(h) if tier else 0
        if packing or size < BIG_BLOCK:
            copy += size
    return copy <= max_copy_bytes


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
    """``hash -> tensor`` from a :func:`serve_run` reply: views of the one frame, no copy."""
    import math

    layout, frames = resp["arena"], resp.get("frames")
    if not (
        isinstance(layout, (list, tuple))
        and len(layout) in (4, 5)
        and isinstance(frames, (list, tuple))
        and len(frames) == 1
        and (len(layout) == 4 or layout[4] == "layer-major")
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
    flat = _frame_tensor(frames[0])
    per_token = math.prod(shape) * dtype.itemsize
    if sum(tokens) * per_token != flat.numel():
        raise ValueError(
            f"peer sent a zero-copy frame of {flat.numel()} bytes for {sum(tokens)} tokens of {per_token} bytes"
        )
    L, two, H, D = shape
    out, offset = {}, 0
    if layer_major:  # one joined [L, 2, H, P, D] tensor: its blocks are token slices of it
        joined = flat.view(dtype).view(L, two, H, sum(tokens), D)
        for i, t in zip(index, tokens):
            out[hashes[i]] = joined[:, :, :, offset : offset + t]
            offset += t
        return out
    for i, t in zip(index, tokens):
        size = t * per_token
        out[hashes[i]] = flat[offset : offset + size].view(dtype).view(L, two, H, t, D)
        offset += size
    return out


def unpack_blocks(resp: dict, hashes: Sequence[bytes] | None = None) -> dict:
    """``hash -> tensor`` from a :func:`serve_blocks` reply; each tensor is a view of its frame.

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
    blocks: dict[bytes, object]  # hash -> tensor
    nbytes: int
    seconds: float
    zero_copy: bool = False  # the holder sent one run of its memory (no packing copy)


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
    """Fetch ``hashes`` from the worker at ``address``; raises OSError/TimeoutError on failure.

    Blocks the holder no longer has are simply absent from the result. With
    ``emulated_bandwidth`` (bytes/s) the pull takes at least ``bytes / bandwidth``: an
    emulated slow link, so the transfer/recompute crossover shows on one machine.
    """
    t0 = time.perf_counter()
    resp = await call(pool, address, HANDLER, connect_timeout=connect_timeout, timeout=timeout, hashes=list(hashes))
    blocks = unpack_blocks(resp, hashes)
    nbytes = sum(tensor_bytes(t) for t in blocks.values())
    if emulated_bandwidth:
        await asyncio.sleep(max(0.0, nbytes / emulated_bandwidth - (time.perf_counter() - t0)))
    return PullResult(blocks, nbytes, time.perf_counter() - t0, zero_copy="arena" in resp)
