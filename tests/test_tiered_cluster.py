"""The tiered store under a real workflow: tight budgets, spills to disk, damaged files."""

from __future__ import annotations

import os

import dask
import pytest
from distributed import Client, LocalCluster

import dask_kvstate as kvs

from .conftest import CONTEXT, TEST_CONFIG, on

BLOCK = 16 * 512  # tiny-llama: 16 tokens per block (TEST_CONFIG) x 512 bytes of KV per token
WORDS = CONTEXT.split()


def branch_text(i: int) -> str:
    """About 110 tokens of text that differs between branches from its first word."""
    rot = WORDS[i % len(WORDS) :] + WORDS[: i % len(WORDS)]
    return f" Branch {i} says: " + " ".join(rot[:60])


@pytest.fixture
def tight_client(tmp_path):
    with dask.config.set(TEST_CONFIG):
        with (
            LocalCluster(
                n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0", local_directory=str(tmp_path)
            ) as cluster,
            Client(cluster) as client,
        ):
            yield client


def test_fork_heavy_workflow_ten_times_over_budget(tight_client):
    client = tight_client
    context = CONTEXT[:200]  # 3 blocks shared by every branch
    budget = 11 * BLOCK  # one branch state in use, plus a little
    kvs.install(client, "tiny-llama", torch_threads=1, device_bytes=budget, host_bytes=budget, disk_bytes="1GiB")
    (w,) = client.nthreads()
    with on(w):
        root = kvs.materialize(context)
        branches = [kvs.extend(s, branch_text(i)) for i, s in enumerate(kvs.fork(root, 16))]
    branches = client.persist(branches)  # all 16 states live at once: the working set
    refs = client.gather(client.compute(branches))
    unique = set().union(*(r.blocks for r in refs))
    assert len(unique) * BLOCK >= 10 * budget

    with on(w):
        answers = [kvs.resume(b, " Verdict:", max_new_tokens=8) for b in branches]
    got = dask.compute(*answers)
    want = dask.compute(*[kvs.generate(context, branch_text(i), " Verdict:", max_new_tokens=8) for i in range(16)])
    assert [g.token_ids for g in got] == [x.token_ids for x in want]

    s = kvs.stats(client).workers[w]
    assert s["tiers"]["device"]["peak_bytes"] <= budget
    assert s["tiers"]["disk"]["spills"] == 0 and s["tiers"]["host"]["spills"] > 0  # it really went to disk
    assert s["tiers"]["disk"]["hits"] > 0  # and came back from there
    assert s.get("recomputes", 0) == 0  # nothing lost on the way
    assert s["blocks"] >= len(unique)  # every referenced block kept, somewhere


async def _spill_files(dask_worker) -> list[str]:
    import asyncio

    store = dask_worker.plugins["kvstate"].runtime.store
    await asyncio.wrap_future(store.settled())  # the spills the task's end asked for have run
    return [store.disk.path(h) for h in store.disk]


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_damaged_spill_files_are_detected_and_recomputed(tight_client, damage):
    client = tight_client
    kvs.install(client, "tiny-llama", torch_threads=1, device_bytes=BLOCK, host_bytes=BLOCK, disk_bytes="1GiB")
    state = client.persist(kvs.materialize(CONTEXT))
    ref = state.compute()
    ((w, files),) = client.run(_spill_files).items()
    assert len(files) >= len(ref.blocks) - 2  # all but what fits in device + host
    for path in files:
        if damage == "delete":
            os.remove(path)
            continue
        with open(path, "r+b") as f:
            if damage == "truncate":
                f.truncate(40)
            else:
                f.seek(-16, 2)
                f.write(b"\xff" * 16)
    out = client.compute(kvs.resume(state, " Who tests?", max_new_tokens=16)).result()
    want = client.compute(kvs.generate(CONTEXT, " Who tests?", max_new_tokens=16)).result()
    assert out.token_ids == want.token_ids
    s = kvs.stats(client).workers[w]
    assert s["tiers"]["disk"]["checksum_failures"] >= 1 and s["recomputes"] >= 1
    assert s["tiers"]["disk"]["checksum_failures"] == len(files)  # every damaged file detected and counted


def _monitor_spills_kv(dask_worker) -> dict:
    data = dask_worker.memory_manager.data
    store = dask_worker.plugins["kvstate"].runtime.store
    before = len(store.disk)
    freed = data.evict()  # what distributed's memory monitor calls past the spill threshold
    return {
        "wrapper": type(data).__name__,
        "freed": freed,
        "to_disk": len(store.disk) - before,
        "data_is_shared": dict(data) == dict(dask_worker.state.data),
    }


def test_dask_memory_monitor_spills_kv_blocks_first(tight_client):
    client = tight_client
    kvs.install(client, "tiny-llama", torch_threads=1)
    state = client.persist(kvs.materialize(CONTEXT))
    ref = state.compute()
    (res,) = client.run(_monitor_spills_kv).values()
    assert res == {"wrapper": "KVStateSpillData", "freed": BLOCK, "to_disk": 1, "data_is_shared": True}
    out = client.compute(kvs.resume(state, " Who tests?", max_new_tokens=8)).result()
    assert out.token_ids == client.compute(kvs.generate(CONTEXT, " Who tests?", max_new_tokens=8)).result().token_ids
    assert out.reused_tokens >= ref.num_tokens - 1  # the spilled block came back from disk
