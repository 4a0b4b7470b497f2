"""The holder's side of a KV pull: the ``kvstate_get_blocks`` handler's reply.

Each tensor goes out as a uint8 view of its memory wrapped in ``to_serialize``, so
Dask sends the buffer as its own frame: no pickling, no copy on the way out (CUDA
blocks are staged through host memory). Three shapes of reply, cheapest first: the
one run of memory the blocks already form (:func:`serve_run`, zero-copy), one frame
packed into a reused buffer (:class:`~dask_kvstate.plugins.worker.packing.PackingBuffers`),
or large blocks as their own frames and small ones packed a few MiB to a frame. The
puller's side, which reads every shape back, is :mod:`dask_kvstate.plugins.worker.transport`.
"""

from __future__ import annotations

from collections.abc import Sequence

from distributed.protocol import to_serialize

from dask_kvstate.blocks import follows, nbytes
from dask_kvstate.plugins.worker.packing import PackingBuffers


def _raw(t):
    """A tensor's bytes as a flat uint8 tensor (CUDA blocks staged through host memory)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous().reshape(-1).view(torch.uint8)


BIG_BLOCK = 1 << 20  # bytes: without a packing buffer, a block this large is its own frame
GROUP = 4 << 20  # bytes: without a packing buffer, smaller blocks share frames of about this size
#: bytes: a zero-copy reply's runs go out in frames of at most this much (whole blocks each).
#: The puller's comm reads every frame into a new buffer; below glibc's mmap threshold
#: (raised to 32 MiB by ``worker.malloc-retain``) that buffer comes from the heap the
#: worker keeps warm, where a larger one is fresh pages from the kernel, several times
#: slower to fill (docs/design/transport.md).
RUN_FRAME = 16 << 20


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
    bookkeeping. Raw bytes
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
    for h in dict.fromkeys(hashes):  # a hash asked for twice is sent once
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

    group: list = []
    group_bytes = 0

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
    """The zero-copy reply, or None when the present blocks are not runs of memory.

    When every present block sits in a memory tier and together they are a few runs of
    memory (a block arena, frames received earlier; see
    :mod:`dask_kvstate.plugins.worker.arena`) or all of one joined copy, the frames
    are that memory itself: nothing is copied. Runs go out in frames of whole blocks, at
    most :data:`RUN_FRAME` bytes each (one block alone may be more). The layout is small
    enough to ride in the message (dtype, the block shape without its token axis, and
    run-lengths of token counts and of request positions: a few dozen bytes), so it
    needs neither a tail in a frame nor a frame of its own. Otherwise None, and
    :func:`serve_blocks` packs. Never raises.
    """

    if store is None:
        return None
    tensors, index, seen = [], [], set()
    for i, h in enumerate(hashes):
        if h in seen or store.where(h) is None:  # a hash asked for twice is sent once
            continue
        seen.add(h)
        t = store.peek_memory(h)
        if t is None:  # on disk (or changing tier right now): pack from a fresh read
            return None
        tensors.append(t)
        index.append(i)
    if not tensors or not all(
        t.dim() == 5 and t.shape[:3] == tensors[0].shape[:3] and t.shape[4] == tensors[0].shape[4] for t in tensors
    ):
        return None
    frames, order = _block_frames(tensors), []
    if frames is None:
        joined = _whole_joined(tensors)
        frames, order = (None, []) if joined is None else ([joined], ["layer-major"])
    if frames is None:
        return None
    L, two, H, _, D = tensors[0].shape
    tokens = runs([int(t.shape[3]) for t in tensors], step=0)
    layout = [str(tensors[0].dtype).removeprefix("torch."), [L, two, H, D], tokens, runs(index, step=1), *order]
    return {"status": "OK", "frames": [to_serialize(f.numpy()) for f in frames], "arena": layout}


def _block_frames(tensors: Sequence) -> list | None:
    """``tensors`` as flat uint8 frames of their own memory, each whole blocks of one run
    and at most :data:`RUN_FRAME` bytes unless one block is more; None when they are not
    one run, or runs of at least :data:`BIG_BLOCK` bytes on average (many small frames:
    packing them is cheaper)."""
    from dask_kvstate.plugins.worker.arena import span

    groups: list[list] = []
    size = 0  # bytes of the last group
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        n = nbytes(t)
        if groups and size + n <= RUN_FRAME and follows(groups[-1][-1], t):
            groups[-1].append(t)
            size += n
        else:
            groups.append([t])
            size = n
    if len(groups) > 1 and sum(nbytes(t) for t in tensors) < BIG_BLOCK * len(groups):
        return None
    return [span(g) for g in groups]


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


def runs(values: Sequence[int], step: int) -> list[list[int]]:
    """Run-length code: ``[[first value, count], ...]`` of runs that grow by ``step``.

    Examples
    --------
    >>> runs([64, 64, 64, 7], step=0), runs([0, 1, 2, 5], step=1)
    ([[64, 3], [7, 1]], [[0, 3], [5, 1]])
    """
    out: list[list[int]] = []
    for v in values:
        if out and v == out[-1][0] + step * out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def serve_inline(store, hashes: Sequence[bytes], max_copy_bytes: int, packing: bool = True) -> bool:
    """Whether :func:`serve_blocks` is cheap enough for the event loop: every block in a
    memory tier (no disk read, no checksum) and at most ``max_copy_bytes`` to copy
    (all of them when ``packing`` into one frame, else the small ones)."""
    if store is None:
        return True
    copy = 0
    for h in dict.fromkeys(hashes):
        tier = store.where(h)
        if tier == "disk":
            return False
        size = store.size_of(h) if tier else 0
        if packing or size < BIG_BLOCK:
            copy += size
    return copy <= max_copy_bytes


async def send_reply(comm, reply: dict, buffers: PackingBuffers | None, serializers=None):
    """Write a reply packed into a lent buffer on ``comm`` here, and give the buffer back once written.

    What a handler returns: ``reply`` itself when it uses no lent buffer (the server
    writes it), else ``Status.dont_reply``, the reply being written already. Dask's TCP
    comm returns from ``write`` with the frames still queued in tornado's stream, so
    "written" is when that stream has handed every queued byte to the socket (the
    kernel holds a copy then); only then is the buffer released for another reply. On a
    comm that cannot tell (in-process, where the puller gets this very array; any other
    transport) or when the write fails, the buffer is abandoned: never reused.
    """
    from distributed.core import Status

    if buffers is None or "tail" not in reply:  # only a packed reply is in a lent buffer
        return reply
    frame = reply["frames"][0].data
    if not buffers.lends(frame):
        return reply
    try:
        await comm.write(reply, serializers=serializers)
        done = await written(comm)
    except BaseException:
        buffers.abandon(frame)
        raise
    (buffers.release if done else buffers.abandon)(frame)
    return Status.dont_reply


async def written(comm) -> bool:
    """Wait until everything written to ``comm`` has left this process; False where the comm cannot tell."""
    from distributed.comm.tcp import TCP
    from tornado.iostream import StreamClosedError

    stream = comm.stream if isinstance(comm, TCP) else None  # TLS is a TCP comm too
    if stream is None:
        return False
    try:
        # Resolves once the stream has written every byte queued before it (tornado's
        # write futures are ordered by the stream's total write index).
        await stream.write(b"")
    except StreamClosedError:
        return False
    return True
