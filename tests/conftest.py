"""Shared fixtures: a real two-process cluster running tiny-llama."""

from __future__ import annotations

import contextlib
import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dask
import pytest
from distributed import Client, LocalCluster, get_client

import dask_kvstate as kvs
from dask_kvstate.testing.processes import fork_worker_processes

# Worker processes forked from a server that imported torch, transformers and the worker
# plugin once, not spawned (each spawned worker imports them anew: seconds per cluster).
# The UCX settings of tests/test_comms.py must reach the fork server: set before it starts.
os.environ.setdefault("UCX_TLS", "tcp,self,sm")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
fork_worker_processes()

# A raw vLLM engine (the bench's baseline; tests/test_beyond_memory.py, test_sessions_vs_raw.py)
# runs its engine core in the raw engine's own process, not in a second process vLLM would
# spawn and import itself into: on 2 cores 15 s less to start and 3 s less to close each raw
# engine, and the same outputs, which is what these tests compare. The bench keeps vLLM's default.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

#: Config under which a cluster's workers are spawned after all: a vLLM engine in a worker
#: forked from the fork server hung in tests/test_vllm.py (two engines, each in its worker).
SPAWNED = {"distributed.worker.multiprocessing-method": "spawn"}

# vLLM engines in workers run eager here (~12 s to start against ~25 s compiled, ~55 s on a
# machine's first compile): what most tests check is kvstate around the engine. The token
# identity checks of tests/test_vllm.py run the default, compiled engine.
dask.config.set({"kvstate.vllm.compile": False})

# A block size that makes short test prompts span several blocks.
TEST_CONFIG = {"kvstate.block-tokens": 16, "kvstate.placement.rule": "pull"}

CONTEXT = (
    "The planner reads the task and writes a plan. The developer follows the plan and writes the code. "
    "The tester runs the tests and reports what failed, and the developer tries again. "
) * 3


def compute_released(*outs):
    """``dask.compute(*outs)`` on the current client, returning once the client has released them.

    ``Client.get`` releases its futures through callbacks on the client's event loop. A
    compute of the same keys made before those run finds the finished futures and returns
    their results: the scheduler never runs the new graph (the compiler's plan for it comes
    too late). Tests that compute one workflow twice, without and with ``kvs.stateflow()``,
    compute the first through this; ``sync`` runs after the queued releases.
    """
    results = dask.compute(*outs)
    get_client().sync(_nothing)
    return results


async def _nothing() -> None:
    """A coroutine for ``Client.sync`` to run on the client's loop, after what is queued there."""


@contextlib.contextmanager
def kv_cluster(
    config: dict = TEST_CONFIG, model="tiny-llama", *, n_workers: int = 2, install: dict | None = None, **cluster_kwargs
):
    """A client of a fresh cluster of ``n_workers`` worker processes running ``model`` under ``config``;
    ``install`` holds more arguments of ``kvs.install`` (tier budgets)."""
    with dask.config.set(config):
        with (
            LocalCluster(
                n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0", **cluster_kwargs
            ) as cluster,
            Client(cluster) as client,
        ):
            kvs.install(client, model, torch_threads=1, **(install or {}))
            yield client


@pytest.fixture(scope="session")
def cluster():
    with dask.config.set(TEST_CONFIG):
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as c:
            yield c


@pytest.fixture(scope="session")
def client(cluster):
    with dask.config.set(TEST_CONFIG), Client(cluster) as c:
        kvs.install(c, "tiny-llama", torch_threads=1)
        yield c


@pytest.fixture(scope="session")
def workers(client):
    return sorted(client.nthreads())


@pytest.fixture(scope="session")
def backend():
    from dask_kvstate.backends import load_backend

    return load_backend("tiny-llama")


@pytest.fixture(scope="session")
def other_model(backend, tmp_path_factory):
    """Another real model: tiny-llama's architecture with different (seeded) weights, in a folder."""
    import torch
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("other-model")
    with torch.random.fork_rng():
        torch.manual_seed(1)
        LlamaForCausalLM(backend.model.config).save_pretrained(folder)
    backend.tokenizer.save_pretrained(folder)
    return str(folder)


@functools.cache
def vllm_missing() -> str | None:
    """Why the vLLM tests skip here, or None where vLLM is usable (the ``vllm`` extra).

    Asked when the first test marked ``needs_vllm`` is set up, not when this file is imported:
    importing vLLM takes 6 s of CPU, which every process importing a test module (the ten of
    tests/test_compiler_acyclic.py's hash-seed check, the pytest worker running no vLLM test)
    would otherwise pay."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # a CUDA-linked torchvision next to the CPU torch breaks the import itself
        return f"vLLM is not usable here ({type(e).__name__}: {e}); pip install 'dask-kvstate[vllm]'"
    return None


def pytest_runtest_setup(item):
    """Skip, saying why, a test marked ``needs_vllm`` where vLLM is not usable."""
    if item.get_closest_marker("needs_vllm") is not None and (why := vllm_missing()) is not None:
        pytest.skip(why)


#: The marks of every vLLM test module: slow (an engine starts in about a minute), skipped,
#: saying why, where vLLM is not usable, and in one xdist group: ``make test`` runs two
#: pytest workers, and two engines on one host's cores at once would each think it had them all.
VLLM_TESTS = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.needs_vllm,
    pytest.mark.xdist_group("vllm"),
]


def vllm_test(test):
    """Give one test the marks of the vLLM test modules (``VLLM_TESTS``)."""
    for mark in VLLM_TESTS:
        test = mark(test)
    return test


def transformers_continuation(model, ids: list[int], new_tokens: int) -> list[int]:
    """The tokens transformers' own ``model.generate`` continues ``ids`` with, greedily."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def vllm_prompts() -> list[tuple[str, str]]:
    """The vLLM tests' prompts: one shared 12-paragraph context and three questions about it."""
    from dask_kvstate.bench.tree_of_thought import QUESTIONS, prompt_parts

    return [prompt_parts(12, q) for q in QUESTIONS[:3]]


def on(worker):
    """Pin the tasks built inside to one worker."""
    return dask.annotate(workers=[worker], allow_other_workers=False)


def stats_of(client, worker) -> dict:
    return kvs.stats(client).workers[worker]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook reads the groups
def pytest_collection_modifyitems(items):
    """Run tests/test_scheduling.py first: its ``gen_cluster`` tests check the process
    for leaked clusters and clients, which the session-scoped fixtures above are. Then
    the vLLM tests, the longest group, so that the other pytest worker of ``make test``
    (``-n 2 --dist loadgroup``) has the rest to run beside them, not after.

    Every other test is grouped by its module: one pytest worker runs a module's tests,
    so its module-scoped clusters and network namespaces are made once, not once per worker.
    """
    first = ("tests/test_scheduling.py", "tests/test_hints.py", "tests/test_distributed_contract.py")
    items.sort(key=lambda item: (not item.nodeid.startswith(first), item.get_closest_marker("xdist_group") is None))
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent with -p no:xdist
def pytest_xdist_node_collection_finished(node, ids):
    """Refuse to run where ``--dist loadgroup`` does not group (read on the controller, from
    the test ids a pytest worker collected): pytest-xdist marks a test's group by renaming its
    node id, which pytest 9.2 no longer reads, and then the vLLM tests run on both pytest
    workers at once, each starting engines that think they have every core, and every module
    fixture is made once per worker. setup.cfg pins pytest below 9.2."""
    if node.config.getoption("dist") == "loadgroup" and ids and not any("@" in i for i in ids):
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup did not group the tests with pytest {pytest.__version__} "
            f"(e.g. {ids[0]!r} has no @group): install the test extra's pins (pip install -e '.[test]')"
        )
