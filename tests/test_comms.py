"""Cross-worker KV moves on every comm Dask offers: TLS and UCX, besides the TCP of the other tests.

Each runs on a cluster of two worker processes speaking that protocol end to end: the
block pull, the placement extension's reports and decisions, and the explicit transfer
all ride the cluster's own comm, and every output is token-identical to text replay.
UCX needs ``ucxx`` (``make test`` installs it where the wheels can be had); on a
machine without RDMA or GPUs it runs over loopback TCP and shared memory.
"""

from __future__ import annotations

import os

import dask
import pytest
from distributed.utils_test import poll_for

import dask_kvstate as kvs

from .conftest import CONTEXT, TEST_CONFIG, kv_cluster, on


def _cluster_kwargs(protocol: str) -> dict:
    if protocol == "tls":
        pytest.importorskip("cryptography")
        return {"security": True}
    pytest.importorskip(
        "distributed_ucxx",
        reason="UCX comm not installed (pip install ucxx-cu12; pip install --no-deps distributed-ucxx-cu12)",
    )
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")  # inherited by the worker processes
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    return {"protocol": "ucx"}


@pytest.fixture(scope="module", params=["tls", "ucx"])
def comm_client(request):
    # TEST_CONFIG's rule "pull": every miss crosses the comm
    with kv_cluster(TEST_CONFIG, **_cluster_kwargs(request.param)) as client:
        yield request.param, client


def test_resume_on_another_worker_pulls_over_the_comm(comm_client):
    protocol, client = comm_client
    a, b = sorted(client.nthreads())
    assert a.startswith(f"{protocol}://") and b.startswith(f"{protocol}://")
    before = kvs.stats(client).workers[b]
    with on(a):
        state = kvs.materialize(CONTEXT, " over the wire")
    with on(b):
        out = kvs.resume(state, " Who tests?", max_new_tokens=16)
    ref, got = dask.compute(state, out)
    want = client.compute(kvs.generate(CONTEXT, " over the wire", " Who tests?", max_new_tokens=16)).result()
    after = kvs.stats(client).workers[b]
    assert got.token_ids == want.token_ids
    assert after["transfers"] - before.get("transfers", 0) == len(ref.blocks)
    assert after["transfer_bytes"] - before.get("transfer_bytes", 0) == ref.nbytes


def test_explicit_transfer_and_fork_across_workers(comm_client):
    protocol, client = comm_client
    a, b = sorted(client.nthreads())
    with on(a):
        state = kvs.materialize(CONTEXT, " moved by hand")
    with on(b):
        moved = kvs.transfer(state, b)
        answers = [kvs.resume(s, f" Branch {i}?", max_new_tokens=8) for i, s in enumerate(kvs.fork(moved, 2))]
    ref, got = dask.compute(moved, answers)
    assert ref.placement.worker == b and ref.lineage.op == "transfer"
    for i, g in enumerate(got):
        want = client.compute(kvs.generate(CONTEXT, " moved by hand", f" Branch {i}?", max_new_tokens=8)).result()
        assert g.token_ids == want.token_ids


def test_placement_decides_with_numbers_measured_on_this_comm(comm_client):
    protocol, client = comm_client
    a, b = sorted(client.nthreads())
    with on(a):
        state = kvs.materialize(CONTEXT, f" placed over {protocol}")
    with on(b):
        out = kvs.resume(state, " Next?", max_new_tokens=8)
    got = client.compute(out).result()
    want = client.compute(kvs.generate(CONTEXT, f" placed over {protocol}", " Next?", max_new_tokens=8)).result()
    assert got.token_ids == want.token_ids

    def outcomes():
        return [e for _, e in client.get_events("kvstate-placement") if e["kind"] == "outcome" and e["worker"] == b]

    poll_for(outcomes, timeout=10)  # outcomes reach the scheduler on the workers' next report
    last = outcomes()[-1]
    assert last["action"] == "pull" and last["seconds"] > 0  # the configured rule, carried out
    assert last["t_transfer"] > 0 and last["t_recompute"] > 0  # both estimates, from this comm's measurements
