"""Failures on a real process cluster: the holder dies, the consumer still answers correctly."""

from __future__ import annotations

import os

import dask
import pytest
from distributed import wait
from distributed.utils_test import poll_for

import dask_kvstate as kvs

from .conftest import CONTEXT, TEST_CONFIG, kv_cluster, on

FAST_FAIL = {**TEST_CONFIG, "kvstate.transport.connect-timeout": "1s"}


@pytest.fixture
def fresh_client():
    with kv_cluster(FAST_FAIL) as client:
        yield client


async def _die(dask_worker):
    os._exit(1)


def kill(client, address):
    """Kill a worker process; its nanny starts a replacement on a new address."""
    client.run(_die, workers=[address], wait=False)
    poll_for(lambda: address not in client.nthreads(), timeout=30)
    client.wait_for_workers(2, timeout=60)


def test_holder_killed_consumer_recomputes_identically(fresh_client):
    client = fresh_client
    a, b = sorted(client.nthreads())
    with on(a):
        ref = client.compute(kvs.materialize(CONTEXT)).result()
    assert ref.placement.worker == a
    expected = client.compute(kvs.generate(CONTEXT, " Who tests?", max_new_tokens=16)).result()

    kill(client, a)

    # The ref (metadata) survived in the client; its blocks died with the holder.
    with on(b):
        out = client.compute(kvs.resume(ref, " Who tests?", max_new_tokens=16)).result()
    assert out.token_ids == expected.token_ids
    s = kvs.stats(client).workers[b]
    assert s["transfer_failures"] >= 1 and s["recomputes"] == len(ref.blocks)


def test_holder_killed_before_a_future_consumer_runs(fresh_client):
    client = fresh_client
    a, b = sorted(client.nthreads())
    # A loose restriction: after the holder dies Dask may rebuild the ref elsewhere.
    with dask.annotate(workers=[a], allow_other_workers=True):
        state = kvs.materialize("Second. " + CONTEXT)
    state = client.persist(state)
    wait(state)
    assert state.compute().placement.worker == a
    kill(client, a)
    # Dask's own lineage rebuilds the lost ref elsewhere; the answer is unchanged.
    out = client.compute(kvs.resume(state, " Who plans?", max_new_tokens=16)).result()
    expected = client.compute(kvs.generate("Second. " + CONTEXT, " Who plans?", max_new_tokens=16)).result()
    assert out.token_ids == expected.token_ids
