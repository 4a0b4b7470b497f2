"""Tenants: two clients with two namespaces on one cluster share no key and no block.

The namespace is fixed on the client when a graph is built and is part of every key
and every block hash on every path: the explicit operators, ``kvs.generate`` under
``kvs.stateflow()`` (the compiler's inserted materialize / resume / resume_many tasks),
and the local prefix cache. Equal graphs from two tenants are different Dask keys, so
the scheduler never hands one tenant the other's results; equal prompts from two
tenants are different blocks, so a hit (and the faster first token it gives) is only
ever on one's own namespace. Within a namespace sharing works as before, and every
output is token-identical to text replay.

Every task is pinned to one worker: the worst case for isolation (every block of every
tenant lands in one store) and what makes the counters exact.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import dask
import pytest
from dask.highlevelgraph import HighLevelGraph
from distributed import Client, get_task_stream

import dask_kvstate as kvs

from .conftest import CONTEXT, kv_cluster, on, stats_of

DOC = "Tenant isolation check. " + CONTEXT
QUESTIONS = [
    " Question: who writes the plan?",
    " Question: who runs the tests?",
    " Question: what happens when a test fails?",
    " Question: who reads the task first?",
]
COUNTERS = ("block_hits", "prefix_cache_hits", "prefill_tokens", "reused_tokens")
MAX_NEW = 6


@pytest.fixture(scope="module")
def tenants():
    """``(admin, tenant_a, tenant_b, worker)``: three clients of one fresh two-worker cluster."""
    with kv_cluster() as admin:
        worker = sorted(admin.nthreads())[0]
        with (
            Client(admin.cluster, set_as_default=False) as a,
            Client(admin.cluster, set_as_default=False) as b,
        ):
            yield admin, a, b, worker


@pytest.fixture(scope="module")
def replay(tenants):
    """Text replay (no state, no prefix cache) of ``DOC + q`` for every question."""
    admin, _, _, worker = tenants
    with on(worker):
        outs = [kvs.generate(DOC, q, max_new_tokens=MAX_NEW) for q in QUESTIONS]
    return dict(zip(QUESTIONS, (g.token_ids for g in admin.gather(admin.compute(outs)))))


@dataclass
class Run:
    results: list = field(repr=False)
    futures: list = field(repr=False)  # held, so the scheduler keeps the outputs while the other tenant runs
    keys: set = field(repr=False)  # every key of the graph as the scheduler runs it (after the compiler)
    ran: set = field(repr=False)  # the keys that ran on a worker during this compute
    delta: dict  # the worker's counters: after minus before
    new_blocks: set = field(repr=False)  # hashes of the blocks this compute added to the worker's store


def _graph_keys(outs, compiled: bool) -> set:
    graph = HighLevelGraph.merge(*[o.__dask_graph__() for o in outs])
    if compiled:
        graph = kvs.optimize(graph, [o.key for o in outs])
    return set(graph.to_dict())


def _blocks(dask_worker) -> set:
    return set(dask_worker.plugins["kvstate"].runtime.store)


def run(client, namespace: str, worker: str, build, *, stateflow: bool = False, config: dict | None = None) -> Run:
    """Build ``build()`` and compute it with ``client``, both under ``kvstate.namespace = namespace``."""
    before, blocks = stats_of(client, worker), client.run(_blocks, workers=[worker])[worker]
    with dask.config.set({"kvstate.namespace": namespace, **(config or {})}):
        with on(worker):
            outs = build()
        keys = _graph_keys(outs, stateflow)
        with kvs.stateflow() if stateflow else contextlib.nullcontext(), get_task_stream(client) as stream:
            futures = client.compute(outs)
            results = client.gather(futures)
    after = stats_of(client, worker)
    ran = {t["key"] for t in stream.data}
    delta = {c: after.get(c, 0) - before.get(c, 0) for c in COUNTERS}
    new_blocks = client.run(_blocks, workers=[worker])[worker] - blocks
    return Run(results, futures, keys, ran, delta, new_blocks)


def generations(questions, **kwargs):
    return lambda: [kvs.generate(DOC, q, max_new_tokens=MAX_NEW, **kwargs) for q in questions]


def assert_apart(a: Run, b: Run) -> None:
    """No key in common, and ``b`` ran every task of its own graph (nothing handed over from ``a``)."""
    assert a.keys.isdisjoint(b.keys), sorted(map(str, a.keys & b.keys))
    assert {f.key for f in a.futures}.isdisjoint(f.key for f in b.futures)
    assert b.keys <= b.ran, sorted(map(str, b.keys - b.ran))


def assert_strangers(a: Run, b: Run) -> None:
    """``a`` and ``b`` ran the same graph as two tenants: no key, no block, no hit in common;
    ``b`` did exactly the work ``a`` did, as if ``a`` had never run."""
    assert_apart(a, b)
    assert a.new_blocks and b.new_blocks.isdisjoint(a.new_blocks)
    assert len(b.new_blocks) == len(a.new_blocks)
    assert b.delta == a.delta


@pytest.mark.parametrize("held", [True, False], ids=["a-held", "a-released"])
@pytest.mark.parametrize("batch", [16, 1], ids=["resume_many", "resume"])
def test_stateflow_generate_shares_no_key_and_no_block_across_tenants(tenants, replay, batch, held):
    """The compiler's inserted states take the namespace of the calls they serve.

    With tenant A's results still held, a shared key would hand them to tenant B; with
    them released, B would recompute A's keys and hit A's blocks. Neither happens.
    """
    admin, client_a, client_b, worker = tenants
    config = {"kvstate.compiler.batch-siblings": batch}
    ns_a, ns_b = f"flow-a-{batch}-{held}", f"flow-b-{batch}-{held}"
    build = generations(QUESTIONS[:2])
    first = run(client_a, ns_a, worker, build, stateflow=True, config=config)
    if not held:
        first.futures.clear()
    other = run(client_b, ns_b, worker, build, stateflow=True, config=config)  # the same graph, as tenant B
    again = run(client_a, ns_a, worker, generations(QUESTIONS[2:]), stateflow=True, config=config)

    inserted = {str(k).split("-")[1] for k in other.keys - {f.key for f in other.futures}}
    assert inserted == ({"materialize", "resume_many"} if batch > 1 else {"materialize"})
    assert_strangers(first, other)
    # Within tenant A: one state task for the document in both graphs, its blocks are
    # hits, only the new questions are prefilled.
    shared = first.keys & again.keys
    assert len(shared) == 1 and str(next(iter(shared))).startswith("kvs-materialize-")
    assert again.delta["block_hits"] > first.delta["block_hits"]
    assert again.delta["prefill_tokens"] < first.delta["prefill_tokens"] // 2
    assert len(again.new_blocks) < len(first.new_blocks)
    for r, qs in ((first, QUESTIONS[:2]), (other, QUESTIONS[:2]), (again, QUESTIONS[2:])):
        assert [g.token_ids for g in r.results] == [replay[q] for q in qs]


def test_prefix_cache_shares_no_key_and_no_block_across_tenants(tenants, replay):
    admin, client_a, client_b, worker = tenants
    build = generations(QUESTIONS[:1], prefix_cache=True)
    first = run(client_a, "cache-a", worker, build)
    other = run(client_b, "cache-b", worker, build)
    third = run(admin, "cache-c", worker, build)  # a third namespace, after both
    again = run(client_a, "cache-a", worker, generations(QUESTIONS[1:2], prefix_cache=True))

    for x, y in ((first, other), (first, third), (other, third)):
        assert_strangers(x, y)
    assert_apart(first, again)
    assert [r.delta["prefix_cache_hits"] for r in (first, other, third)] == [0, 0, 0]
    assert again.delta["prefix_cache_hits"] > 0
    assert again.delta["prefill_tokens"] < first.delta["prefill_tokens"] // 2
    for r, q in ((first, 0), (other, 0), (third, 0), (again, 1)):
        assert [g.token_ids for g in r.results] == [replay[QUESTIONS[q]]]


def explicit(questions):
    """Every operator on a state: materialize, fork, resume, extend, merge, resume_many."""

    def build():
        state = kvs.materialize(DOC)
        left, right = kvs.fork(state, 2)
        longer = kvs.extend(state, questions[1])
        return [
            kvs.resume(left, questions[0], max_new_tokens=MAX_NEW),
            kvs.resume(kvs.merge(right, longer), "", max_new_tokens=MAX_NEW),
            *kvs.resume_many(state, questions[:2], max_new_tokens=MAX_NEW),
        ]

    return build


def test_explicit_operators_share_no_key_and_no_block_across_tenants(tenants, replay):
    admin, client_a, client_b, worker = tenants
    first = run(client_a, "explicit-a", worker, explicit(QUESTIONS[:2]))
    other = run(client_b, "explicit-b", worker, explicit(QUESTIONS[:2]))
    again = run(client_a, "explicit-a", worker, explicit(QUESTIONS[2:]))

    assert_strangers(first, other)
    assert {str(k).split("-")[1] for k in first.keys & again.keys} >= {"materialize", "fork"}  # one state
    assert again.delta["block_hits"] > first.delta["block_hits"]
    assert again.delta["prefill_tokens"] < first.delta["prefill_tokens"]
    for r, qs in ((first, QUESTIONS[:2]), (other, QUESTIONS[:2]), (again, QUESTIONS[2:])):
        assert [g.token_ids for g in r.results] == [replay[qs[0]], replay[qs[1]], replay[qs[0]], replay[qs[1]]]


def test_a_state_handed_to_another_tenant_keeps_its_namespace(tenants, replay):
    """Tenant B given tenant A's ref may use it (it was handed the ref), under keys of its
    own; the blocks stay hashed with the ref's namespace, so they are A's blocks."""
    admin, client_a, client_b, worker = tenants
    with dask.config.set({"kvstate.namespace": "handed-a"}), on(worker):
        ref = client_a.compute(kvs.materialize(DOC)).result()
    assert ref.namespace == "handed-a"

    def build():
        longer = kvs.extend(ref, QUESTIONS[0])
        return [longer, kvs.resume(ref, QUESTIONS[1], max_new_tokens=MAX_NEW), kvs.fork(ref, 1)[0]]

    mine = run(client_a, "handed-a", worker, build)
    theirs = run(client_b, "handed-b", worker, build)
    assert_apart(mine, theirs)
    assert mine.new_blocks and not theirs.new_blocks  # B's extend hashes as A's ref: blocks A's extend made
    for r in (mine, theirs):
        longer, answer, forked = r.results
        assert (longer.namespace, forked.namespace) == ("handed-a", "handed-a")
        assert longer.blocks[: len(ref.blocks) - 1] == ref.blocks[:-1]
        assert answer.token_ids == replay[QUESTIONS[1]]
        assert r.delta["block_hits"] > 0


# -- graphs only: no cluster ----------------------------------------------------------------


def _keys_as(namespace: str, build) -> list:
    with dask.config.set({"kvstate.namespace": namespace}):
        outs = build()
    return [o.key for o in outs]


def test_every_operator_key_carries_the_namespace():
    ref = kvs.materialize(DOC, namespace="fixed")

    def build():
        state = kvs.materialize(DOC)
        return [
            state,
            kvs.generate(DOC, max_new_tokens=2),
            kvs.generate(DOC, max_new_tokens=2, prefix_cache=True),
            kvs.extend(ref, "x"),
            kvs.resume(ref, "x", max_new_tokens=2),
            *kvs.resume_many(ref, ["x", "y"], max_new_tokens=2),
            *kvs.fork(ref, 2),
            kvs.merge(ref, state),
            kvs.transfer(ref, "tcp://127.0.0.1:1"),
            kvs.evict(ref),
        ]

    a, a2, b = _keys_as("k-a", build), _keys_as("k-a", build), _keys_as("k-b", build)
    assert set(a).isdisjoint(b)
    # Deterministic within a namespace, except the explicitly unique transfer and evict.
    assert a[:-2] == a2[:-2] and set(a[-2:]).isdisjoint(a2[-2:])
    assert kvs.generate(DOC, namespace="k-b").key == _keys_as("k-b", lambda: [kvs.generate(DOC)])[0]


def test_the_compiler_takes_the_namespace_from_the_calls_never_from_config():
    def build():
        return [kvs.generate(DOC, q, max_new_tokens=2) for q in QUESTIONS[:2]]

    with dask.config.set({"kvstate.namespace": "g-a"}):
        outs = build()
    with dask.config.set({"kvstate.namespace": "g-b"}):
        outs += build()
    graph = HighLevelGraph.merge(*[o.__dask_graph__() for o in outs])
    with dask.config.set({"kvstate.namespace": "scheduler", "kvstate.compiler.batch-siblings": 1}):
        dsk = kvs.optimize(graph, [o.key for o in outs]).to_dict()
    with dask.config.set({"kvstate.compiler.batch-siblings": 1}):
        same = kvs.optimize(graph, [o.key for o in outs]).to_dict()
    assert set(dsk) == set(same)
    states = {k: t for k, t in dsk.items() if str(k).startswith("kvs-materialize-")}
    # One state per tenant, never one shared by both, each with its tenant's namespace.
    assert sorted(t.kwargs["namespace"] for t in states.values()) == ["g-a", "g-b"]
    for o in outs:
        resume = dsk[o.key]
        assert resume.kwargs["namespace"] == states[resume.args[0].key].kwargs["namespace"]
    plan = kvs.explain(*outs)
    assert len(plan.plan.states) == 2
