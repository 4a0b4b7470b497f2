"""Block pulls ride the cluster's own comm: here TLS between two worker processes."""
from __future__ import annotations

import dask
import pytest
from distributed import Client, LocalCluster

import dask_kvstate as kvs

from .conftest import CONTEXT, TEST_CONFIG, on

pytest.importorskip("cryptography")


def test_blocks_move_over_tls_and_output_matches_replay():
    with dask.config.set(TEST_CONFIG):
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, security=True,
                          dashboard_address=":0") as cluster, Client(cluster) as client:  # fmt: skip
            kvs.install(client, "tiny-llama", torch_threads=1)
            a, b = sorted(client.scheduler_info()["workers"])
            assert a.startswith("tls://")
            with on(a):
                state = kvs.materialize(CONTEXT)
            with on(b):
                out = kvs.resume(state, " Who tests?", max_new_tokens=16)
            ref, got = dask.compute(state, out)
            want = client.compute(kvs.generate(CONTEXT, " Who tests?", max_new_tokens=16)).result()
            s = kvs.stats(client)[b]
    assert got.token_ids == want.token_ids
    assert s["transfers"] == len(ref.blocks) and s["transfer_bytes"] == ref.nbytes


def test_served_blocks_are_zero_copy_frames_not_pickles():
    import torch
    from distributed.protocol import deserialize, serialize

    from dask_kvstate.plugins.block_store import TieredBlockStore
    from dask_kvstate.transport import serve_blocks, unpack_blocks

    store = TieredBlockStore(device_bytes=2**22, host_bytes=2**22, disk_bytes=2**22)
    block = torch.arange(2 * 2 * 2 * 16 * 16 * 64, dtype=torch.float32).reshape(2, 2, 2, 16, 1024)  # 1 MiB: its own frame
    store.put(b"h" * 16, block)
    reply = serve_blocks(store, [b"h" * 16, b"x" * 16])
    assert [row[0] for row in reply["layout"]] == [b"h" * 16] and reply["missing"] == [b"x" * 16]
    header, frames = serialize(reply["frames"][0].data)
    assert header["serializer"] == "dask"  # Dask's numpy serializer, not pickle
    data_frame = max(frames, key=lambda f: memoryview(f).nbytes)
    assert memoryview(data_frame).nbytes == block.nelement() * 4
    assert torch.frombuffer(data_frame, dtype=torch.float32).data_ptr() == block.data_ptr()  # no copy
    back = unpack_blocks({**reply, "frames": [deserialize(header, [bytearray(f) for f in frames])]})
    assert torch.equal(back[b"h" * 16], block)
    store.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_blocks_of_any_dtype_survive_the_wire(dtype):
    import torch
    from distributed.protocol import deserialize, serialize

    from dask_kvstate.plugins.block_store import TieredBlockStore
    from dask_kvstate.transport import serve_blocks, unpack_blocks

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
