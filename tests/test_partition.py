"""A holder cut off from the network mid-workflow, with Dask's default timeouts.

Two hosts in network namespaces (:mod:`dask_kvstate.testing.hosts`), every Dask timeout
at its default (comm connect 30 s, worker-ttl 5 minutes). A state is made on ``w0``; its
link goes down; consumers on ``w1`` fork and resume the state. They get the ref through
the scheduler (``placement.ref-copy-bytes``), not from the holder they cannot reach;
their pull of its blocks gives the holder ``transport.connect-timeout`` and recomputes;
every output equals text replay.

Runs as root where namespaces work; skips with the reason elsewhere.
"""

from __future__ import annotations

import time

import dask
import pytest

import dask_kvstate as kvs
from dask_kvstate import tasks
from dask_kvstate.protocol import WORKER_PLUGIN
from dask_kvstate.testing.hosts import Hosts, skip_reason

from .conftest import CONTEXT, TEST_CONFIG, on

pytestmark = [
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
    pytest.mark.slow,  # a cluster of its own (Dask's defaults): over a minute on 2 cores, mostly starting it
]

QUESTION = " Who tests the code?"


@pytest.fixture(scope="module")
def hosts():
    # TEST_CONFIG's rule is "pull": the consumer dials the holder for its blocks, the worst case
    with Hosts(n_workers=2) as h, dask.config.set(TEST_CONFIG), h.client() as client:
        kvs.install(client, "tiny-llama", torch_threads=1)
        h.kv_client = client  # type: ignore[attr-defined]
        yield h


def _dask_timeouts() -> tuple:
    return dask.config.get("distributed.comm.timeouts.connect"), dask.config.get("distributed.scheduler.worker-ttl")


def _counters(dask_worker) -> dict:
    return dict(dask_worker.plugins[WORKER_PLUGIN].runtime.counters)


def test_a_holder_cut_off_costs_its_consumers_the_kv_connect_timeout_not_dasks(hosts):
    client = hosts.kv_client
    a, b = hosts.workers["w0"], hosts.workers["w1"]
    assert set(client.run(_dask_timeouts).values()) == {("30s", "5 minutes")}  # Dask's defaults
    assert client.run_on_scheduler(_dask_timeouts) == ("30s", "5 minutes")
    text = "Cut off. " + CONTEXT
    want = client.submit(tasks.generate, text + QUESTION, max_new_tokens=12, workers=[b], pure=False).result()
    with dask.annotate(workers=[a], allow_other_workers=True):  # Dask may rebuild it elsewhere once a is gone
        state = client.persist(kvs.materialize(text))
    ref = state.compute()
    assert ref.placement.worker == a
    before = client.run(_counters, workers=[b])[b]
    hosts.link_down("w0")
    t0 = time.perf_counter()
    try:
        with on(b):
            outs = client.compute([kvs.resume(s, QUESTION, max_new_tokens=12) for s in kvs.fork(state, 2)])
        got = [o.result(timeout=120) for o in outs]
        seconds = time.perf_counter() - t0
        after = client.run(_counters, workers=[b])[b]
    finally:
        hosts.link_up("w0")

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    print(
        f"holder's link down, Dask's default timeouts -> workflow done in {seconds:.1f} s; ref copies "
        f"+{delta('ref_copies')}, transfer failures +{delta('transfer_failures')}, recomputed "
        f"{delta('recomputes')} of {len(ref.blocks)} blocks"
    )
    assert [g.token_ids for g in got] == [want.token_ids] * 2
    assert delta("ref_copies") >= 1  # the ref came through the scheduler, not from the holder
    assert delta("transfer_failures") >= 1  # the pull of its blocks gave up on the holder ...
    assert delta("recomputes") == len(ref.blocks)  # ... and the consumer recomputed them
