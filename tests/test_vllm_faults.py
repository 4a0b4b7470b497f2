"""Tenants and faults on a vLLM worker of a real cluster (a worker process under a nanny).

* Sessions on a vLLM worker: each session's end reaches the worker and frees its KV.
* Two namespaces on one engine: the engine's own prefix cache hits within a namespace,
  never across (every request carries its namespace as vLLM's ``cache_salt``).
* An engine step that raises while several tasks share it: every task still returns
  replay's tokens (the step's requests are retried after the engine dropped its cache).
* The engine's driver thread dying: the waiting task fails with an error naming the
  engine or runs again elsewhere, the worker leaves, its nanny starts a fresh one, and
  the cluster serves the same tokens again.

Skips, saying why, where vLLM is not installed (the ``vllm`` extra).
"""

from __future__ import annotations

import dask
import pytest
from distributed import Client, LocalCluster, wait
from distributed.utils_test import poll_for

import dask_kvstate as kvs
from dask_kvstate.protocol import WORKER_PLUGIN

from .conftest import SPAWNED, VLLM_TESTS, vllm_prompts

pytestmark = VLLM_TESTS

PARTS = vllm_prompts()
DOC = PARTS[0][0]


def _backend(dask_worker):
    return dask_worker.plugins[WORKER_PLUGIN].runtime.backend


def _engine_hits(client) -> int:
    return sum(s["engine"]["engine_prefix_hit_tokens"] for s in kvs.stats(client).workers.values())


def _session_bytes(client) -> int:
    from dask_kvstate.testing.footprint import worker_footprint

    return sum(f["session_bytes"] for f in client.run(worker_footprint).values())


def _ask(namespace: str, suffix: str):
    with dask.config.set({"kvstate.namespace": namespace}):
        return kvs.generate(DOC, suffix, max_new_tokens=12)


def test_tenants_and_faults_on_a_vllm_worker():
    from dask_kvstate.errors import EngineFailed
    from dask_kvstate.testing.engine_faults import fail_steps, stop_driver

    config = {"kvstate.block-tokens": 64, "distributed.scheduler.allowed-failures": 5, **SPAWNED}
    with (
        dask.config.set(config),
        LocalCluster(n_workers=1, threads_per_worker=3, processes=True, dashboard_address=":0") as cluster,
    ):
        with Client(cluster) as client:
            kvs.install(client, "smollm2-135m", backend="vllm")
            (first_worker,) = client.nthreads()
            client.run(lambda dask_worker: _backend(dask_worker).reset_engine_cache())

            # Tenants: the first asks; the second asks with the same document; the first again.
            (a1,) = dask.compute(_ask("tenant-a", PARTS[0][1]))
            hits0 = _engine_hits(client)
            (b1,) = dask.compute(_ask("tenant-b", PARTS[1][1]))
            across = _engine_hits(client) - hits0
            (a2,) = dask.compute(_ask("tenant-a", PARTS[1][1]))
            within = _engine_hits(client) - hits0 - across
            assert across == 0 and b1.prefill_tokens == b1.prompt_tokens
            assert within > 0 and a2.prefill_tokens < a2.prompt_tokens
            assert a2.token_ids == b1.token_ids

            # Sessions on the vLLM worker: each one's end reaches the worker and frees its KV.
            for i in range(3):
                with kvs.session(f"vllm-session-{i}"):
                    state = kvs.materialize(DOC)
                    (answer,) = dask.compute(kvs.resume(state, PARTS[i][1], max_new_tokens=4))
                    assert answer.token_ids
                del state
            poll_for(lambda: kvs.stats(client).lifecycle.get("invalidations", 0) >= 3, timeout=120)
            poll_for(lambda: _session_bytes(client) == 0, timeout=120)
            assert kvs.stats(client).lifecycle.get("invalidations_unhandled", 0) == 0

            # A failed step among three tasks sharing the engine: every output as replay's.
            replay = [a1, a2, None]
            (replay[2],) = dask.compute(_ask("tenant-a", PARTS[2][1]))
            client.run(lambda dask_worker: _backend(dask_worker).reset_engine_cache())
            client.run(lambda dask_worker: fail_steps(_backend(dask_worker), 1))
            got = dask.compute(*[_ask("tenant-a", suffix) for _, suffix in PARTS])
            assert [g.token_ids for g in got] == [r.token_ids for r in replay]
            counters = client.run(lambda dask_worker: dict(_backend(dask_worker).exchange.counters))
            assert counters[first_worker]["failed_steps"] >= 1 and counters[first_worker]["retried_requests"] >= 1

            # The driver dies: the worker leaves, its nanny starts a fresh one, which serves the same tokens.
            client.run(lambda dask_worker: stop_driver(_backend(dask_worker)))
            future = client.compute(_ask("tenant-a", PARTS[0][1] + " "))
            poll_for(lambda: first_worker not in client.nthreads(), timeout=120)
            wait(future, timeout=600)
            if future.status == "error":  # it failed on the dead engine, before the worker left
                with pytest.raises(EngineFailed, match="vLLM engine .* stopped"):
                    future.result()
            else:  # Dask ran it again on the fresh worker
                assert future.status == "finished", future.status
                assert future.result().token_ids
            client.wait_for_workers(1, timeout=600)
            (again,) = dask.compute(_ask("tenant-a", PARTS[0][1]))
            assert again.token_ids == a1.token_ids
            assert first_worker not in client.nthreads()
