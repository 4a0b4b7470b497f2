"""The tiered block store, step by step: which block sits in which tier after each call."""

from __future__ import annotations

import os

import pytest
import torch

from dask_kvstate.plugins.worker.block_store import TieredBlockStore
from dask_kvstate.plugins.worker.tiers import DiskTier, ScoredLRU

from .mapping_kit import check_mapping

B = 40  # bytes in one test block: 10 float32


def block(fill: float = 0.0) -> torch.Tensor:
    return torch.full((10,), fill)


@pytest.fixture
def store(tmp_path):
    s = TieredBlockStore(str(tmp_path / "blocks"), device_bytes=2 * B, host_bytes=2 * B, disk_bytes=100 * B)
    yield s
    s.close()


def layout(store) -> dict:
    return {t: sorted(getattr(store, t)) for t in ("device", "host", "disk")}


# -- conformance of every tier mapping ----------------------------------------------


def test_disk_tier_is_a_mapping(tmp_path):
    check_mapping(DiskTier(str(tmp_path), capacity=10**6))


def test_a_memory_tier_is_a_mapping():
    check_mapping(ScoredLRU(10**6, {}, score=lambda k, now: 0.0, movable=lambda k: True))


# -- placement, step by step ---------------------------------------------------------


def test_blocks_flow_down_the_tiers_and_back_up(store):
    for h in (b"a", b"b"):
        store.put(h, block())
    assert layout(store) == {"device": [b"a", b"b"], "host": [], "disk": []}
    store.put(b"c", block())
    assert layout(store) == {"device": [b"b", b"c"], "host": [b"a"], "disk": []}
    store.put(b"d", block())
    store.put(b"e", block())
    assert layout(store) == {"device": [b"d", b"e"], "host": [b"b", b"c"], "disk": [b"a"]}
    assert torch.equal(store.get(b"a"), block())  # from disk, back to the device tier
    assert store.where(b"a") == "device" and len(store) == 5
    s = store.stats()["tiers"]
    assert (s["disk"]["hits"], s["device"]["misses"], s["host"]["misses"]) == (1, 1, 1)
    assert s["device"]["spills"] >= 3 and s["host"]["spills"] >= 1 and s["device"]["unspills"] == 1


def test_eviction_follows_reuse_not_just_recency(store):
    store.put(b"hot", block())
    for _ in range(5):
        store.get(b"hot")  # read by five branches
    store.put(b"cold", block())
    store.put(b"new", block())  # device over budget: who goes down?
    assert store.where(b"hot") == "device" and store.where(b"cold") == "host"


def test_pinned_blocks_never_move(store):
    store.put(b"a", block())
    store.pin("task-1", [b"a"])
    for h in (b"b", b"c", b"d"):
        store.put(h, block())
    assert store.where(b"a") == "device"
    assert store.offload([b"a"], "disk") == 0 and store.where(b"a") == "device"
    store.unpin("task-1")
    assert store.offload([b"a"], "disk") == 1 and store.where(b"a") == "disk"


def test_forked_blocks_exist_once_whatever_the_tier(store):
    for h in (b"a", b"b", b"c", b"d", b"e"):
        store.put(h, block())
    store.put(b"a", block(9.0))  # a fork re-putting a shared block: no second copy
    assert sum(b"a" in getattr(store, t) for t in ("device", "host", "disk")) == 1
    assert len(store) == 5


def test_holds_keep_blocks_when_the_disk_is_full(tmp_path):
    store = TieredBlockStore(str(tmp_path), device_bytes=B, host_bytes=B, disk_bytes=B)
    store.hold("ref", [b"a", b"b", b"c"])
    for h in (b"a", b"b", b"c", b"d"):
        store.put(h, block())
    # Three referenced blocks fill the three tiers; "d" has nowhere to go but is
    # unreferenced, so it is dropped (to be recomputed) rather than a held one.
    assert all(h in store for h in (b"a", b"b", b"c"))
    assert store.stats()["dropped"] >= 1 and store.stats()["tiers"]["disk"]["full"] >= 1
    store.close()


def test_unreferenced_blocks_make_room_on_disk(tmp_path):
    store = TieredBlockStore(str(tmp_path), device_bytes=B, host_bytes=B, disk_bytes=2 * B)
    for h in (b"a", b"b", b"c", b"d", b"e"):
        store.put(h, block())
    assert len(store) == 4 and store.disk.total <= 2 * B  # the oldest unreferenced went
    store.close()


def test_discard_frees_only_unreferenced_blocks(store):
    for h in (b"a", b"b", b"c"):
        store.put(h, block())
    store.hold("fork", [b"a"])
    assert store.discard([b"a", b"b", b"c", b"zz"]) == 2 * B
    assert list(store) == [b"a"]


def test_prefetch_brings_blocks_up_and_offload_sends_them_down(store):
    for h in (b"a", b"b", b"c", b"d"):
        store.put(h, block())
    assert layout(store) == {"device": [b"c", b"d"], "host": [b"a", b"b"], "disk": []}
    assert store.offload([b"c", b"d"], "disk") == 2
    assert layout(store) == {"device": [], "host": [b"b"], "disk": [b"a", b"c", b"d"]}  # c passing by pushed a down
    assert store.prefetch([b"c"]).result(timeout=10) == 1
    assert store.where(b"c") == "device"
    with pytest.raises(ValueError, match="offload tier"):
        store.offload([b"a"], "tape")


@pytest.mark.parametrize("expected", [True, False])
def test_a_prefetched_block_a_task_is_expected_to_read_is_evicted_last(store, expected):
    """A prefetch brings a block up for a task predicted soon; by its own record (never
    read since it was stored) it is the coldest block there, so the next overflow would
    send it straight back down unless it is marked expected, until a task pins it."""
    store.put(b"due", block())
    store.put(b"hot", block())
    for _ in range(5):
        store.get(b"hot")
    store.offload([b"due"], "disk")
    if expected:
        store.expect([b"due"], within_s=60.0)
    assert store.prefetch([b"due"]).result(timeout=10) == 1
    store.put(b"new", block())  # the device tier over budget: the one just put, or the due one, goes down
    assert layout(store)["host"] == ([b"new"] if expected else [b"due"])
    store.pin("task", [b"due"])  # the task came and read it: an ordinary block again
    store.unpin("task")
    assert not store.ledger.expected


def test_an_expected_mark_lapses_at_its_deadline_and_an_offload_clears_it(store):
    store.put(b"a", block())
    store.put(b"b", block())
    store.expect([b"a"], within_s=0.0)  # a task that was due now and did not come
    store.put(b"c", block())
    assert store.where(b"a") == "host"  # the oldest, as if never marked
    store.expect([b"b"], within_s=60.0)
    store.unexpect([b"b"])
    assert b"b" not in store.ledger.expected


# -- the disk format ---------------------------------------------------------------


def spill_all(store, *hashes):
    for h in hashes:
        store.put(h, block(float(h[0])))
    store.offload(list(hashes), "disk")
    return [store.disk.path(h) for h in hashes]


def test_spill_files_are_private_raw_bytes(store):
    (path,) = spill_all(store, b"a")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(store.directory).st_mode & 0o777 == 0o700
    data = open(path, "rb").read()
    assert data.startswith(b"KVB1") and b"pickle" not in data and len(data) < B + 200


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "garbage"])
def test_damaged_spill_file_is_a_counted_miss(store, damage):
    (path,) = spill_all(store, b"a")
    if damage == "flip":
        data = bytearray(open(path, "rb").read())
        data[-3] ^= 0x55
        open(path, "wb").write(data)
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 7)
    elif damage == "delete":
        os.remove(path)
    else:
        open(path, "wb").write(b"#!/bin/sh\necho not a block\n")
    assert store.get(b"a") is None
    assert b"a" not in store
    assert store.stats()["tiers"]["disk"]["checksum_failures"] == 1


def test_memory_monitor_eviction_moves_kv_to_disk(store):
    from dask_kvstate.plugins.worker.memory import KVStateSpillData

    data = KVStateSpillData({"task-result": 1}, store)
    for h in (b"a", b"b", b"c"):
        store.put(h, block())
    assert data.fast and data["task-result"] == 1 and len(data) == 1
    assert data.evict() == B
    assert layout(store)["disk"] == [b"a"]
    assert data.evict() == B and data.evict() == B
    assert len(store.disk) == 3 and data.evict() == -1  # nothing left in memory, and a dict cannot spill


def test_bad_budgets_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="device_bytes"):
        TieredBlockStore(str(tmp_path), device_bytes=-1, host_bytes=0, disk_bytes=0)


def test_a_real_write_error_keeps_the_block_above_and_leaves_no_partial_file(tmp_path):
    import resource
    import signal

    store = TieredBlockStore(str(tmp_path), device_bytes=0, host_bytes=0, disk_bytes=10**9)
    big = torch.zeros(4096)  # 16 KiB: larger than the file size limit below
    store.hold("ref", [b"held"])
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, old_limit[1]))
    try:  # the kernel now refuses writes past 8 KiB with EFBIG: a real OSError
        store.put(b"held", big)
        store.put(b"loose", big)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert store.where(b"held") in ("device", "host")  # referenced: kept above, over budget
    assert b"loose" not in store  # unreferenced: dropped, to be recomputed
    assert len(store.disk) == 0 and os.listdir(tmp_path) == []  # no half-written file
    assert store.stats()["tiers"]["disk"]["full"] >= 1
    store.close()


def test_a_pinned_block_over_the_budget_does_not_stop_eviction(store):
    store.pin("task", [b"big"])
    store.put(b"big", torch.zeros(100))  # 400 bytes: heavier than the whole device tier
    for h in (b"a", b"b", b"c"):
        store.put(h, block())
    assert store.where(b"big") == "device"
    assert all(store.where(h) != "device" for h in (b"a", b"b"))  # the rest still moved down


def test_adopted_blocks_join_as_a_view_and_spill_intact(tmp_path):
    """After a resume joins a state's blocks, the store keeps the joined copy: one copy, views after."""
    from dask_kvstate.blocks import join_blocks
    from dask_kvstate.plugins.worker.arena import split_blocks

    kv = torch.randn(2, 2, 2, 40, 4)
    hashes = [bytes([i]) * 8 for i in range(3)]  # 16 + 16 + 8 tokens
    s = TieredBlockStore(str(tmp_path / "b"), device_bytes=10**6, host_bytes=0, disk_bytes=10**6)
    for b in split_blocks(kv, hashes, 16):
        s.put(b.hash, b.tensor)
    weight = s.device.total_weight
    joined = join_blocks([s.get(h) for h in hashes])  # a copy: the blocks are separate tensors
    assert s.adopt(hashes, joined, 16) == 3 and s.device.total_weight == weight
    again = join_blocks([s.get(h) for h in hashes])
    assert again.data_ptr() == joined.data_ptr() and torch.equal(again, kv)
    assert join_blocks([s.get(hashes[0]), s.get(hashes[2])]).data_ptr() != joined.data_ptr()  # not consecutive
    # A view spills to disk as its own bytes and comes back equal.
    s.offload([hashes[1]], tier="disk")
    assert hashes[1] in s.disk and torch.equal(s.get(hashes[1]), kv[:, :, :, 16:32])
    s.close()


# -- moves off the caller's thread ----------------------------------------------------


@pytest.fixture
def gated(monkeypatch):
    """Hold every spill-file write of a store at a gate: ``writing`` is set while one waits."""
    import threading

    state = {"gate": threading.Event(), "writing": threading.Event(), "written": threading.Event()}

    def install(store):
        real = store.disk.write

        def write(key, value):
            state["writing"].set()
            state["gate"].wait(10)
            name = real(key, value)
            state["written"].set()
            return name

        monkeypatch.setattr(store.disk, "write", write)
        return state

    return install


def test_a_block_being_spilled_is_served_from_memory_and_may_be_dropped_meanwhile(store, gated):
    for h in (b"a", b"b"):
        store.put(h, block(float(h[0])))
    gate = gated(store)
    moved = store.submit(store.offload, [b"a", b"b"], "disk")
    assert gate["writing"].wait(10)  # a's file is being written: a is still in the host tier
    assert store.where(b"a") == "host" and torch.equal(store.peek(b"a"), block(97.0))
    assert store.stats()["tiers"]["disk"]["blocks"] == 0  # the lock is not held across the write
    assert store.discard([b"a"]) == B  # dropped during its own spill
    gate["gate"].set()
    assert moved.result(10) == 1  # b went down; a's move gave up
    assert b"a" not in store and store.where(b"b") == "disk"
    assert os.listdir(store.directory) == [os.path.basename(store.disk.path(b"b"))]  # no file left for a
    assert (store.disk.total, store.disk.reserved, store.nbytes) == (B, 0, B)


def test_a_block_read_or_pinned_during_its_spill_stays_above(store, gated):
    for h in (b"a", b"b"):
        store.put(h, block(float(h[0])))
    gate = gated(store)
    moved = store.submit(store.offload, [b"a"], "disk")
    assert gate["writing"].wait(10)
    assert torch.equal(store.get(b"a"), block(97.0)) and store.where(b"a") == "device"  # read back up meanwhile
    gate["gate"].set()
    assert moved.result(10) == 0 and store.where(b"a") == "device" and os.listdir(store.directory) == []
    gate["gate"].clear()
    gate["writing"].clear()
    moved = store.submit(store.offload, [b"b"], "disk")
    assert gate["writing"].wait(10)
    store.pin("task", [b"b"])  # a task starts using it mid-move: it stays where it was
    gate["gate"].set()
    assert moved.result(10) == 0 and store.where(b"b") == "host" and os.listdir(store.directory) == []
    assert (store.disk.total, store.disk.reserved) == (0, 0)


def test_the_event_loop_only_asks_for_spills_and_producers_wait_for_them(tmp_path, gated):
    import asyncio
    import threading

    s = TieredBlockStore(str(tmp_path / "b"), device_bytes=2 * B, host_bytes=2 * B, disk_bytes=100 * B)
    hashes = [bytes([i]) for i in range(8)]
    s.pin(("task", "k"), hashes)
    for h in hashes:
        s.put(h, block())  # pinned: nothing may move yet
    assert len(s.device) == 8
    gate = gated(s)

    async def task_end():  # the plugin's transition hook, on the event loop
        s.unpin(("task", "k"))
        return gate["written"].is_set(), s.stats()["tiers"]["device"]["blocks"]

    written, on_device = asyncio.run(task_end())
    assert not written and on_device > 2  # unpin returned with the spill still to do
    assert gate["writing"].wait(10)
    producer = threading.Thread(target=s.put, args=(b"new", block()))
    producer.start()
    producer.join(0.3)
    assert producer.is_alive()  # a task's put waits for the backlog it would add to
    gate["gate"].set()
    producer.join(10)
    assert not producer.is_alive()
    assert s.device.total_weight <= 2 * B and s.host.total_weight <= 2 * B and len(s.disk) == 5
    assert s.nbytes == 9 * B == s.device.total_weight + s.host.total_weight + s.disk.total
    s.close()


def test_a_store_removes_the_folder_it_made_and_keeps_the_one_it_was_given(tmp_path):
    """Without a folder the store spills to one of its own: gone at close, and when an
    unclosed store is collected; a folder it was given (the worker's) stays its owner's."""
    import gc

    made = TieredBlockStore(device_bytes=B, host_bytes=B, disk_bytes=100 * B)
    for h in (b"a", b"b", b"c"):
        made.put(h, block())
    assert made.where(b"a") == "disk" and os.listdir(made.directory)
    made.close()
    assert not os.path.exists(made.directory)

    unclosed = TieredBlockStore(device_bytes=B, host_bytes=B, disk_bytes=100 * B)
    folder = unclosed.directory
    unclosed.mover.close()  # its thread holds the store; what stays is the store itself
    del unclosed
    gc.collect()
    assert not os.path.exists(folder)

    given = TieredBlockStore(str(tmp_path / "given"), device_bytes=B, host_bytes=B, disk_bytes=100 * B)
    given.close()
    assert os.path.isdir(tmp_path / "given")
