"""The wire format of block pulls: raw frames, any dtype, packed into reused buffers."""

from __future__ import annotations

import pytest


def test_served_blocks_are_zero_copy_frames_not_pickles():
    import torch
    from distributed.protocol import deserialize, serialize

    from dask_kvstate.plugins.worker.block_store import TieredBlockStore
    from dask_kvstate.plugins.worker.serve import serve_blocks
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    store = TieredBlockStore(device_bytes=2**22, host_bytes=2**22, disk_bytes=2**22)
    block = torch.arange(2 * 2 * 2 * 16 * 16 * 64, dtype=torch.float32).reshape(
        2, 2, 2, 16, 1024
    )  # 1 MiB: its own frame
    store.put(b"h" * 16, block)
    asked = [b"h" * 16, b"x" * 16]
    reply = serve_blocks(store, asked)  # one block is one run of memory: sent as it is
    assert reply["arena"][3] == [[0, 1]] and len(reply["frames"]) == 1  # present: position 0 of the request
    header, frames = serialize(reply["frames"][0].data)
    assert header["serializer"] == "dask"  # Dask's numpy serializer, not pickle
    data_frame = max(frames, key=lambda f: memoryview(f).nbytes)
    assert memoryview(data_frame).nbytes == block.nelement() * 4
    assert torch.frombuffer(data_frame, dtype=torch.float32).data_ptr() == block.data_ptr()  # no copy
    back = unpack_blocks({**reply, "frames": [deserialize(header, [bytearray(f) for f in frames])]}, asked)
    assert list(back) == [b"h" * 16] and torch.equal(back[b"h" * 16], block)
    store.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_blocks_of_any_dtype_survive_the_wire(dtype):
    import torch
    from distributed.protocol import deserialize, serialize

    from dask_kvstate.plugins.worker.block_store import TieredBlockStore
    from dask_kvstate.plugins.worker.serve import serve_blocks
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    store = TieredBlockStore(device_bytes=2**20, host_bytes=2**20, disk_bytes=2**20)
    block = torch.randn(2, 2, 2, 5, 8).to(getattr(torch, dtype))
    store.put(b"b" * 16, block)
    store.put(b"c" * 16, block * 2)
    reply = serve_blocks(store, [b"b" * 16, b"c" * 16])  # small blocks: packed in one frame
    assert len(reply["frames"]) == 1
    header, frames = serialize(reply["frames"][0].data)
    back = unpack_blocks({**reply, "frames": [deserialize(header, frames)]})
    assert back[b"b" * 16].dtype == block.dtype and torch.equal(back[b"b" * 16], block)
    assert torch.equal(back[b"c" * 16], block * 2)
    store.close()


def test_a_pull_is_one_frame_in_a_buffer_reused_once_the_comm_let_go():
    import gc

    import numpy as np
    import torch
    from distributed.protocol import deserialize, serialize

    from dask_kvstate.plugins.worker.block_store import TieredBlockStore
    from dask_kvstate.plugins.worker.packing import PackingBuffers
    from dask_kvstate.plugins.worker.serve import serve_blocks
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    store = TieredBlockStore(device_bytes=2**24, host_bytes=2**22, disk_bytes=2**22)
    blocks = {bytes([i]) * 16: torch.randn(2, 2, 2, 16, 64 * (i + 1)) for i in range(6)}  # small...
    blocks[b"L" * 16] = torch.randn(2, 2, 2, 16, 2048)  # ...and one of 1 MiB
    for h, t in blocks.items():
        store.put(h, t)
    buffers = PackingBuffers(keep_bytes=2**23)
    reply = serve_blocks(store, list(blocks), buffers)
    assert len(reply["frames"]) == 1
    frame = reply["frames"][0].data
    header, frames = serialize(frame)
    back = unpack_blocks({**reply, "frames": [deserialize(header, [bytearray(f) for f in frames])]})
    assert all(torch.equal(back[h], t) for h, t in blocks.items())
    # While the first reply is still referenced (queued on a comm), a second pull gets new memory...
    second = serve_blocks(store, list(blocks), buffers)["frames"][0].data
    assert not np.shares_memory(second, frame)
    # ...and once both are gone, their buffers are handed out again: no fresh allocation.
    kept = {b.ctypes.data for b in buffers._buffers}
    del reply, frame, frames, second
    gc.collect()
    third = serve_blocks(store, list(blocks), buffers)["frames"][0].data
    assert third.ctypes.data in kept and buffers.nbytes <= buffers.keep_bytes
    # A pull larger than the buffers may keep falls back to a frame per large block.
    assert len(serve_blocks(store, list(blocks), PackingBuffers(keep_bytes=1024))["frames"]) > 1
    store.close()


def test_a_peer_naming_an_unknown_dtype_is_refused():
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    with pytest.raises(ValueError, match="unknown dtype 'nn'"):
        unpack_blocks({"frames": [bytearray(8)], "layout": [[b"h" * 16, "nn", [2], 8, 0, 0]]})
