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


def test_a_pull_is_one_frame_in_a_buffer_reused_once_the_comm_wrote_it():
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
    # While the first reply is lent (its comm has not written it yet), a second pull gets new memory...
    second = serve_blocks(store, list(blocks), buffers)["frames"][0].data
    assert not np.shares_memory(second, frame) and buffers.lent == 2
    # ...and once the comm has written both, their buffers are handed out again: no fresh allocation.
    kept = {frame.ctypes.data, second.ctypes.data}
    buffers.release(frame)
    buffers.release(second)
    third = serve_blocks(store, list(blocks), buffers)["frames"][0].data
    assert third.ctypes.data in kept and buffers.nbytes <= buffers.keep_bytes
    # A pull larger than the buffers may keep falls back to a frame per large block.
    assert len(serve_blocks(store, list(blocks), PackingBuffers(keep_bytes=1024))["frames"]) > 1
    store.close()


def test_idle_reply_buffers_of_different_sizes_are_handed_out_and_dropped_again():
    from dask_kvstate.plugins.worker.packing import PackingBuffers

    buffers = PackingBuffers(keep_bytes=5000)
    big, small = buffers.take(4000), buffers.take(1000)
    buffers.release(big)
    buffers.release(small)  # idle: the big one first
    again = buffers.take(900)  # the smallest that fits is not the first idle buffer
    assert again.ctypes.data == small.ctypes.data and buffers.lent == 1
    buffers.release(again)
    fresh = buffers.take(4500)  # fits neither: the small one is dropped to make room
    assert fresh.ctypes.data not in (big.ctypes.data, small.ctypes.data)
    assert buffers.nbytes <= buffers.keep_bytes


def test_a_peer_naming_an_unknown_dtype_is_refused():
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    with pytest.raises(ValueError, match="unknown dtype 'nn'"):
        unpack_blocks({"frames": [bytearray(8)], "layout": [[b"h" * 16, "nn", [2], 8, 0, 0]]})


def _packed_store(n: int, salt: int):
    """A store with ``n`` blocks of 4 MiB, each its own allocation (so a pull of them is packed)."""
    import torch

    from dask_kvstate.plugins.worker.block_store import TieredBlockStore

    store = TieredBlockStore(device_bytes=2**28, host_bytes=2**20, disk_bytes=2**20)
    blocks = {bytes([salt + i]) * 16: torch.randn(2, 2, 2, 64, 1024) for i in range(n)}
    for h, t in blocks.items():
        store.put(h, t)
    return store, blocks


async def _serving(protocol: str, store, buffers, served: list, small_socket: bool = False):
    """A server answering ``get`` as the worker plugin does: packed into a lent buffer, sent by ``send_reply``."""
    import socket

    from distributed.core import Server

    from dask_kvstate.plugins.worker.serve import send_reply, serve_blocks

    async def get(comm, hashes=()):
        if small_socket:  # so the reply cannot hide in the kernel's socket buffers: it waits in tornado
            comm.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        reply = serve_blocks(store, hashes, buffers, zero_copy=False)
        served.append(reply["frames"][0].data)
        return await send_reply(comm, reply, buffers)

    server = Server({"get": get})
    await server.listen(f"{protocol}://" + ("127.0.0.1:0" if protocol == "tcp" else ""))
    return server


def test_a_packing_buffer_is_never_reused_while_its_reply_is_unsent():
    import asyncio

    async def check():
        import socket

        import numpy as np
        import torch
        from distributed.comm import connect
        from distributed.utils_test import async_poll_for

        from dask_kvstate.plugins.worker.packing import PackingBuffers
        from dask_kvstate.plugins.worker.serve import serve_blocks
        from dask_kvstate.plugins.worker.transport import unpack_blocks

        store, first = _packed_store(4, salt=0)  # 16 MiB
        _, other = _packed_store(4, salt=100)
        for h, t in other.items():
            store.put(h, t)
        buffers, served = PackingBuffers(keep_bytes=2**27), []
        server = await _serving("tcp", store, buffers, served, small_socket=True)
        comm = await connect(server.address)
        comm.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        await comm.write({"op": "get", "hashes": list(first), "reply": True})
        await async_poll_for(lambda: served, timeout=10)
        # The puller reads nothing yet: the reply sits in the holder's stream, its buffer still lent...
        assert buffers.lent == 1
        # ...so another pull (other blocks) is packed elsewhere; reusing the buffer would
        # put these blocks' bytes under the first reply's hashes.
        again = serve_blocks(store, list(other), buffers, zero_copy=False)["frames"][0].data
        assert not np.shares_memory(again, served[0]) and buffers.lent == 2
        back = unpack_blocks(await comm.read(), list(first))
        assert list(back) == list(first) and all(torch.equal(back[h], t) for h, t in first.items())
        # Written: the first reply's buffer is given back and handed out again.
        await async_poll_for(lambda: buffers.lent == 1, timeout=10)
        buffers.release(again)
        third = serve_blocks(store, list(first), buffers, zero_copy=False)["frames"][0].data
        assert third.ctypes.data in {served[0].ctypes.data, again.ctypes.data}
        await comm.close()
        server.stop()
        store.close()

    asyncio.run(check())


def test_a_reply_over_an_in_process_comm_keeps_its_buffer_out_of_the_pool():
    """In one process the puller gets the holder's very array: that buffer is never handed out again."""
    import asyncio

    async def check():
        import numpy as np
        import torch
        from distributed.comm import connect

        from dask_kvstate.plugins.worker.packing import PackingBuffers
        from dask_kvstate.plugins.worker.transport import unpack_blocks

        store, blocks = _packed_store(2, salt=0)
        buffers, served = PackingBuffers(keep_bytes=2**26), []
        server = await _serving("inproc", store, buffers, served)
        comm = await connect(server.address)
        await comm.write({"op": "get", "hashes": list(blocks), "reply": True})
        reply = await comm.read()
        assert np.shares_memory(reply["frames"][0], served[0])  # no copy on the way: the same memory
        assert buffers.lent == 0 and buffers.nbytes == 0  # abandoned: out of the pool for good
        back = unpack_blocks(reply, list(blocks))
        assert all(torch.equal(back[h], t) for h, t in blocks.items())
        await comm.close()
        server.stop()
        store.close()

    asyncio.run(check())


def test_a_hash_asked_for_twice_is_served_once():
    """Duplicates in a request cost the holder nothing: the reply is as large as the distinct blocks."""
    import torch

    from dask_kvstate.plugins.worker.block_store import TieredBlockStore
    from dask_kvstate.plugins.worker.packing import PackingBuffers
    from dask_kvstate.plugins.worker.serve import serve_blocks, serve_inline
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    store = TieredBlockStore(device_bytes=2**22, host_bytes=2**20, disk_bytes=2**20)
    a, b = b"a" * 16, b"b" * 16
    store.put(a, torch.randn(2, 2, 2, 4, 8))
    store.put(b, torch.randn(2, 2, 2, 4, 8))
    asked = [a, b] * 1000
    size = store.size_of(a) + store.size_of(b)
    assert serve_inline(store, asked, max_copy_bytes=size)  # counted once each
    packed = serve_blocks(store, asked, PackingBuffers(keep_bytes=2**22), zero_copy=False)
    assert packed["frames"][0].data.nbytes == size + packed["tail"]
    assert list(unpack_blocks({**packed, "frames": [packed["frames"][0].data]})) == [a, b]
    run = serve_blocks(store, [a, a, a])  # one block: a run of its own memory
    assert run["arena"][3] == [[0, 1]] and run["frames"][0].data.nbytes == store.size_of(a)
    store.close()
