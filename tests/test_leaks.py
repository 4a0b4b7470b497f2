"""Leaks: 1,000 small workflows on one long-lived cluster leave nothing behind.

After the workflows are done and their states evicted and released: no block
refcount (holds, pins, held keys), no block and no byte in any store, no ref in the
scheduler's placement extension; worker RSS within 10% of its level after warm-up.
"""

from __future__ import annotations

import gc

import dask
import pytest
from distributed.utils_test import poll_for

import dask_kvstate as kvs

from .conftest import TEST_CONFIG, kv_cluster, on

WORKFLOWS = 1000
BATCH = 100
TEXT = "Ticket {i}: the checkout page times out after the pool shrank. Triage it and say who owns it."


def _footprint(dask_worker) -> dict:
    import psutil

    gc.collect()
    plugin = dask_worker.plugins["kvstate"]
    store = plugin.runtime.store
    return {
        "rss": psutil.Process().memory_info().rss,
        "blocks": len(store),
        "bytes": store.nbytes,
        "meta": len(store.ledger.meta),
        "holds": len(store.holds.count) + len(store.holds.by_owner),
        "pins": len(store.pins.count) + len(store.pins.by_owner),
        "held_keys": len(plugin.held),
        "tasks": len(dask_worker.state.tasks),
    }


def _extension_refs(dask_scheduler) -> dict:
    ext = dask_scheduler.plugins["kvstate-placement"]
    return {"refs": len(ext.refs), "blocks": sum(len(b) for b in ext.blocks_on.values())}


def run_batch(client, workers, start: int) -> list:
    """``BATCH`` workflows: prefill a ticket, fork it in two, answer from each, evict."""
    states, answers = [], []
    for i in range(start, start + BATCH):
        with on(workers[i % len(workers)]):  # each workflow on one worker, alternating
            state = kvs.materialize(TEXT.format(i=i))
            answers += [kvs.resume(s, f" Owner {j}:", max_new_tokens=2) for j, s in enumerate(kvs.fork(state, 2))]
        states.append(state)
    states = client.persist(states)
    out = dask.compute(*answers)
    freed = client.gather(client.compute([kvs.evict(s) for s in states]))
    assert all(f > 0 for f in freed)
    del states
    return list(out)


@pytest.mark.slow
def test_a_thousand_workflows_leak_nothing():
    with kv_cluster(TEST_CONFIG) as client:
        workers = sorted(client.nthreads())
        done = run_batch(client, workers, 0)  # warm-up: caches, allocator pools, the first plans
        warm = client.run(_footprint)
        for start in range(BATCH, WORKFLOWS, BATCH):
            done += run_batch(client, workers, start)

        def settled():  # forgotten keys and the last block reports arrive asynchronously
            now = client.run(_footprint)
            ext = client.run_on_scheduler(_extension_refs)
            return all(f["tasks"] == 0 and f["blocks"] == 0 for f in now.values()) and ext["blocks"] == 0

        poll_for(settled, timeout=30)
        end = client.run(_footprint)
        ext = client.run_on_scheduler(_extension_refs)
    assert len(done) == 2 * WORKFLOWS and all(d.token_ids for d in done)
    for w in workers:
        e = end[w]
        assert (e["blocks"], e["bytes"], e["meta"], e["holds"], e["pins"], e["held_keys"]) == (0, 0, 0, 0, 0, 0), e
        drift = e["rss"] / warm[w]["rss"] - 1
        print(
            f"{w}: RSS {warm[w]['rss'] / 2**20:.0f} MiB after warm-up -> {e['rss'] / 2**20:.0f} MiB "
            f"after {WORKFLOWS} workflows ({drift:+.1%}); blocks {e['blocks']}, bytes {e['bytes']}"
        )
        assert abs(drift) <= 0.10, (w, warm[w]["rss"], e["rss"])
    assert ext == {"refs": 0, "blocks": 0}, ext
