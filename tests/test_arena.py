"""Block arenas: a prefill's blocks in one buffer, pulled as one zero-copy frame.

The unit tests run the holder's and the puller's halves around Dask's real message
serialization (``to_frames`` / ``from_frames``, msgpack and all); the cluster tests
pull between two worker processes and compare the output with text replay.
"""

from __future__ import annotations

import pytest

import dask_kvstate as kvs

from .conftest import CONTEXT, on


def _arena_store(tokens=70, block_tokens=16, device="cpu"):
    import torch

    from dask_kvstate.plugins.worker.arena import split_blocks
    from dask_kvstate.plugins.worker.block_store import TieredBlockStore

    kv = torch.randn(3, 2, 2, tokens, 8, device=device)
    hashes = [bytes([i]) * 16 for i in range(-(-tokens // block_tokens))]
    blocks = split_blocks(kv, hashes, block_tokens)
    store = TieredBlockStore(device_bytes=2**24, host_bytes=2**24, disk_bytes=2**24, device=device)
    for b in blocks:
        store.put(b.hash, b.tensor)
    return kv, hashes, blocks, store


async def _over_the_wire(reply):
    """``reply`` as the puller's comm hands it over: through Dask's frames and msgpack."""
    from distributed.comm.utils import from_frames, to_frames

    frames = await to_frames(reply)
    return await from_frames([bytearray(f) for f in frames])


def test_a_prefill_is_laid_out_as_views_of_one_block_major_buffer():
    import torch

    kv, hashes, blocks, store = _arena_store(tokens=70)
    assert [b.num_tokens for b in blocks] == [16, 16, 16, 16, 6]  # the partial last block is just shorter
    assert [b.start for b in blocks] == [0, 16, 32, 48, 64]
    for b in blocks:
        assert b.tensor.is_contiguous() and torch.equal(b.tensor, kv[:, :, :, b.start : b.start + b.num_tokens])
    storage = blocks[0].tensor.untyped_storage()
    assert all(b.tensor.untyped_storage().data_ptr() == storage.data_ptr() for b in blocks)
    assert storage.nbytes() == kv.nelement() * kv.element_size()  # the arena is exactly the blocks, no padding
    # Budgets count each block's own bytes; what a lone survivor keeps alive is reported.
    assert store.stats()["arena_overhang_bytes"] == 0
    store.discard(hashes[1:])
    assert store.stats()["arena_overhang_bytes"] == storage.nbytes() - blocks[0].nbytes
    store.close()


@pytest.mark.parametrize("start", [0, 16])
def test_a_backends_own_cache_is_written_into_blocks_once_and_stored_as_they_are(backend, start):
    """The transformers backend writes each cache layer straight into an arena of blocks
    (``kv_to_store``): the same KV as ``kv_from_cache``, one run of memory, and the worker
    stores those very tensors; blocks of another size are laid out again, equal."""
    import torch

    from dask_kvstate.blocks import BlockKV
    from dask_kvstate.plugins.worker.arena import blocks_to_store, span

    ids = backend.tokenize(CONTEXT)
    cache, _ = backend.prefill(ids)
    want = backend.kv_from_cache(cache, start)
    stored = backend.kv_to_store(cache, start, 16)
    assert isinstance(stored, BlockKV) and span(stored.blocks) is not None
    assert [int(b.shape[3]) for b in stored.blocks[:-1]] == [16] * (len(stored.blocks) - 1)
    assert torch.equal(stored.joined(), want)
    hashes = [bytes([i]) * 16 for i in range(-(-len(ids) // 16))]
    kept = blocks_to_store(stored, hashes, 16, first=start // 16, first_token=start)
    assert len(kept) == len(stored.blocks) and all(a.tensor is b for a, b in zip(kept, stored.blocks)), (
        "laid-out blocks are stored as they are"
    )
    assert [b.start for b in kept] == list(range(start, len(ids), 16))
    # blocks of 8 tokens for a store of 16: one copy into an arena of 16-token blocks
    other = blocks_to_store(BlockKV.split(want, 8), hashes, 16, first=start // 16, first_token=start)
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(other, kept)) and len(other) == len(kept)
    assert span([b.tensor for b in other]) is not None


def test_a_run_of_arena_blocks_is_sent_as_its_memory_and_received_as_views(tmp_path):
    import asyncio

    import torch

    from dask_kvstate.plugins.worker.serve import serve_blocks
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    kv, hashes, blocks, store = _arena_store(tokens=70)
    asked = [b"?" * 16, *hashes[1:]]  # one unknown block first, then blocks 1..4 of the arena
    reply = serve_blocks(store, asked)
    assert "arena" in reply and "tail" not in reply
    frame = reply["frames"][0].data
    assert frame.ctypes.data == blocks[1].tensor.data_ptr()  # the arena's own memory: no copy
    assert frame.nbytes == sum(b.nbytes for b in blocks[1:])
    received = asyncio.run(_over_the_wire(reply))
    back = unpack_blocks(received, asked)
    assert list(back) == hashes[1:]  # the unknown one is simply absent
    for b in blocks[1:]:
        assert torch.equal(back[b.hash], b.tensor)
    # The puller's blocks are views of the one received frame, back to back: stored as
    # they are, and served on without a copy too.
    from dask_kvstate.plugins.worker.arena import span

    run = span([back[h] for h in hashes[1:]])
    assert run is not None and run.numel() == frame.nbytes
    store.close()


def test_a_long_run_goes_out_in_frames_of_whole_blocks_and_is_served_on_as_they_came(monkeypatch):
    """Frames of at most RUN_FRAME bytes, each whole blocks of the arena's own memory; the
    puller's blocks are views of them, and serving them on is zero-copy again."""
    import asyncio

    import torch

    from dask_kvstate.plugins.worker import serve
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    kv, hashes, blocks, store = _arena_store(tokens=70)  # 16-token blocks of 6 KiB, the last of 6 tokens
    monkeypatch.setattr(serve, "RUN_FRAME", 2 * blocks[0].nbytes)
    monkeypatch.setattr(serve, "BIG_BLOCK", blocks[0].nbytes)  # frames this small are still worth sending as they are
    reply = serve.serve_blocks(store, hashes)
    sizes = [f.data.nbytes for f in reply["frames"]]
    assert "arena" in reply and sizes == [2 * blocks[0].nbytes, 2 * blocks[0].nbytes, blocks[4].nbytes]
    assert reply["frames"][1].data.ctypes.data == blocks[2].tensor.data_ptr()  # the arena itself, no copy
    back = unpack_blocks(asyncio.run(_over_the_wire(reply)), hashes)
    assert list(back) == hashes and all(torch.equal(back[b.hash], b.tensor) for b in blocks)
    # A puller that serves them on: three runs of memory (its received frames), sent as they are.
    from dask_kvstate.plugins.worker.block_store import TieredBlockStore

    onward = TieredBlockStore(device_bytes=2**24, host_bytes=2**24, disk_bytes=2**24)
    for h, t in back.items():
        onward.put(h, t)
    again = serve.serve_blocks(onward, hashes)
    assert "arena" in again and [f.data.nbytes for f in again["frames"]] == sizes
    assert again["frames"][0].data.ctypes.data == back[hashes[0]].data_ptr()
    # A frame boundary inside a block is refused, not read across.
    torn = {**reply, "frames": [bytearray(blocks[0].nbytes + 8), bytearray(sum(sizes) - blocks[0].nbytes - 8)]}
    with pytest.raises(ValueError, match="ends inside a block"):
        unpack_blocks(torn, hashes)
    store.close()
    onward.close()


def test_an_adopted_state_is_sent_as_its_joined_tensor_and_received_without_a_copy():
    """A holder that resumed a state keeps its blocks as token slices of the joined copy
    (layer-major). Asked for all of them, it sends that tensor's memory; the receiver's
    blocks are slices of the received frame, and joining them is a view, not a copy."""
    import asyncio

    import torch

    from dask_kvstate.blocks import join_blocks
    from dask_kvstate.plugins.worker.packing import PackingBuffers
    from dask_kvstate.plugins.worker.serve import serve_blocks
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    kv, hashes, blocks, store = _arena_store(tokens=70)
    joined = join_blocks([store.get(h) for h in hashes])  # a copy: the arena is block-major
    assert store.adopt(hashes, joined, 16) == len(hashes)
    reply = serve_blocks(store, hashes)
    assert reply["arena"][4:] == ["layer-major"] and "tail" not in reply
    frame = reply["frames"][0].data
    assert frame.ctypes.data == joined.data_ptr() and frame.nbytes == joined.nbytes  # the joined copy itself
    back = unpack_blocks(asyncio.run(_over_the_wire(reply)), hashes)
    assert list(back) == hashes and all(torch.equal(back[b.hash], b.tensor) for b in blocks)
    again = join_blocks([back[h] for h in hashes])
    assert torch.equal(again, kv) and again.data_ptr() == back[hashes[0]].data_ptr()  # a view of the frame
    # Only part of the joined tensor: its bytes are not one run of the blocks asked for.
    part = serve_blocks(store, hashes[1:3], PackingBuffers(keep_bytes=2**22))
    assert "arena" not in part and part.get("tail")
    store.close()


def test_blocks_that_are_not_one_run_of_memory_are_packed():
    import asyncio

    import torch

    from dask_kvstate.plugins.worker.packing import PackingBuffers
    from dask_kvstate.plugins.worker.serve import serve_blocks
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    kv, hashes, blocks, store = _arena_store(tokens=70)
    buffers = PackingBuffers(keep_bytes=2**22)
    cases = {
        "reversed": hashes[::-1],  # in the arena, but not in request order
        "gap": [hashes[0], hashes[2]],  # block 1's bytes lie between them
    }
    other = torch.randn(3, 2, 2, 16, 8)  # a block of another allocation
    store.put(b"o" * 16, other)
    cases["two storages"] = [*hashes[:2], b"o" * 16]
    for why, asked in cases.items():
        reply = serve_blocks(store, asked, buffers)
        assert "arena" not in reply and reply.get("tail"), why
        back = unpack_blocks(asyncio.run(_over_the_wire(reply)), asked)
        want = {b.hash: b.tensor for b in blocks} | {b"o" * 16: other}
        assert list(back) == asked and all(torch.equal(back[h], want[h]) for h in asked), why
    # Switched off, even a run is packed.
    assert "arena" not in serve_blocks(store, hashes, buffers, zero_copy=False)
    store.close()


def test_cuda_blocks_are_staged_through_host_memory_and_packed():
    import asyncio

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from dask_kvstate.plugins.worker.packing import PackingBuffers
    from dask_kvstate.plugins.worker.serve import serve_blocks
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    kv, hashes, blocks, store = _arena_store(tokens=70, device="cuda")
    assert blocks[0].tensor.is_cuda
    reply = serve_blocks(store, hashes, PackingBuffers(keep_bytes=2**22))
    assert "arena" not in reply and reply.get("tail")  # the comm sends host frames: one staging copy anyway
    back = unpack_blocks(asyncio.run(_over_the_wire(reply)), hashes)
    assert all(torch.equal(back[b.hash], b.tensor.cpu()) for b in blocks)
    store.close()


@pytest.mark.parametrize(
    "layout, frame_bytes, match",
    [
        (["nn", [3, 2, 2, 8], [[16, 1]], [[0, 1]]], 16 * 96 * 4, "unknown dtype 'nn'"),
        (["float32", [3, 2, 2, 8], [[16, 2]], [[0, 2]]], 16 * 96 * 4, "frames of 6144 bytes for 32 tokens"),
        (["float32", [3, 2, 2, 8], [[16, 1]], [[7, 1]]], 16 * 96 * 4, "do not match positions"),
        (["float32", [3, 2, 2, 8], [[16, 1]], [[0, 10**12]]], 16 * 96 * 4, "more positions than the 2 blocks"),
        (["float32", [3, 2, 2, -8], [[16, 1]], [[0, 1]]], 16 * 96 * 4, "bad block shape"),
        (["float32", [3, 2, 2, 8], [["16", 1]], [[0, 1]]], 16 * 96 * 4, "malformed token counts runs"),
        (["float32", [3, 2, 2, 8]], 16 * 96 * 4, "malformed zero-copy reply"),
    ],
)
def test_a_malformed_zero_copy_reply_is_refused_by_name(layout, frame_bytes, match):
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    with pytest.raises(ValueError, match=match):
        unpack_blocks({"status": "OK", "frames": [bytearray(frame_bytes)], "arena": layout}, [b"a" * 16, b"b" * 16])


def _holder_counters(client, worker) -> dict:
    s = kvs.stats(client).workers[worker]
    return {k: s.get(k, 0) for k in ("served_zero_copy", "served_packed", "pulls_zero_copy", "pulls_packed")}


def test_a_pull_of_a_prefill_takes_the_zero_copy_path_and_matches_replay(client, workers):
    a, b = workers
    before_a, before_b = _holder_counters(client, a), _holder_counters(client, b)
    # A text of its own: b may hold blocks of CONTEXT from other tests of this session's
    # cluster, and a pull of part of a state is packed.
    text = "Arena first. " + CONTEXT
    with on(a):
        state = kvs.materialize(text, " laid out in one arena")
    with on(b):
        out = kvs.resume(state, " Who tests?", max_new_tokens=12)
    got = client.compute(out).result()
    want = client.compute(kvs.generate(text, " laid out in one arena", " Who tests?", max_new_tokens=12)).result()
    after_a, after_b = _holder_counters(client, a), _holder_counters(client, b)
    assert got.token_ids == want.token_ids
    assert after_a["served_zero_copy"] - before_a["served_zero_copy"] == 1
    assert after_a["served_packed"] == before_a["served_packed"]
    assert after_b["pulls_zero_copy"] - before_b["pulls_zero_copy"] == 1


def test_a_pull_from_a_holder_that_resumed_takes_the_zero_copy_path(client, workers):
    a, b = workers
    # Blocks hash as a chain from the first token: a text of its own, so b holds none of
    # them and asks for all (a pull of part of a joined copy is packed).
    text = "Adopted first. " + CONTEXT
    with on(a):
        state = kvs.materialize(text, " resumed at its holder first")
        first = kvs.resume(state, " Who plans?", max_new_tokens=4)
    client.compute(first).result()  # the holder adopts its joined copy
    before_a, before_b = _holder_counters(client, a), _holder_counters(client, b)
    with on(b):
        out = kvs.resume(state, " Who tests?", max_new_tokens=12)
    got = client.compute(out).result()
    want = client.compute(kvs.generate(text, " resumed at its holder first", " Who tests?", max_new_tokens=12)).result()
    after_a, after_b = _holder_counters(client, a), _holder_counters(client, b)
    assert got.token_ids == want.token_ids
    assert after_a["served_zero_copy"] - before_a["served_zero_copy"] == 1
    assert after_b["pulls_zero_copy"] - before_b["pulls_zero_copy"] == 1


def test_an_extended_state_spans_two_arenas_and_falls_back_to_packing(client, workers):
    a, b = workers
    before_a, before_b = _holder_counters(client, a), _holder_counters(client, b)
    with on(a):
        base = kvs.materialize(CONTEXT, " two arenas")
        longer = kvs.extend(base, " The reviewer reads the diff and asks for one more test before merging.")
    with on(b):
        out = kvs.resume(longer, " Who reviews?", max_new_tokens=12)
    got = client.compute(out).result()
    want = client.compute(
        kvs.generate(
            CONTEXT,
            " two arenas",
            " The reviewer reads the diff and asks for one more test before merging.",
            " Who reviews?",
            max_new_tokens=12,
        )
    ).result()
    after_a, after_b = _holder_counters(client, a), _holder_counters(client, b)
    assert got.token_ids == want.token_ids
    # the base's blocks are one arena, the extension's new blocks another: not one run
    assert after_a["served_packed"] - before_a["served_packed"] == 1
    assert after_a["served_zero_copy"] == before_a["served_zero_copy"]
    assert after_b["pulls_packed"] - before_b["pulls_packed"] == 1


def test_fuzz_zero_copy_layouts_raise_only_value_error():
    """Random damage to a real zero-copy reply's layout: refused with ValueError, or
    blocks that exactly tile the frame; never another exception, never a read past it."""
    import copy
    import random

    import torch

    from dask_kvstate.plugins.worker.serve import serve_run
    from dask_kvstate.plugins.worker.transport import unpack_blocks

    kv, hashes, blocks, store = _arena_store(tokens=70)
    reply = serve_run(store, hashes)
    frame = bytearray(reply["frames"][0].data.tobytes())
    junk = [None, -1, 0, 1, 2, 16, 10**18, 2.5, "16", b"x", [], [0], [[0, 1]], {"a": 1}, True, "float32", "uint8"]
    rng = random.Random(0)
    refused = 0
    for _ in range(1500):
        layout = copy.deepcopy(reply["arena"])
        for _ in range(rng.randint(1, 3)):
            node, path = layout, []
            while isinstance(node, list) and node and rng.random() < 0.7:
                i = rng.randrange(len(node))
                path.append(i)
                node = node[i]
            if not path:
                layout = rng.choice(junk)
                break
            parent = layout
            for i in path[:-1]:
                parent = parent[i]
            parent[path[-1]] = rng.choice(junk)
        try:
            back = unpack_blocks({"status": "OK", "frames": [frame], "arena": layout}, hashes)
        except ValueError:
            refused += 1
            continue
        assert sum(t.nelement() * t.element_size() for t in back.values()) == len(frame)
        assert all(isinstance(t, torch.Tensor) for t in back.values())
    assert refused > 1000
    store.close()
