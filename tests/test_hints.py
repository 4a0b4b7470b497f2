"""Component hints (Nalar Table 2): ``max-concurrency`` and ``batchable``, on real clusters.

Most tests use ``gen_cluster`` (scheduler and workers in the test's event loop, tasks in
worker threads), so they read the scheduler's and workers' state directly; one test runs
a two-process ``LocalCluster`` and counts running tasks with a cluster-wide ``Lock`` and
``Variable``. Tasks block on distributed ``Event``s rather than sleeping, so what a test
sees does not depend on the machine's speed.
"""

from __future__ import annotations

import threading

import dask
import pytest
from distributed import Client, Event, LocalCluster, Lock, Variable
from distributed.utils_test import async_poll_for, gen_cluster

import dask_kvstate as kvs
from dask_kvstate import config
from dask_kvstate.hints import parse_hints
from dask_kvstate.plugins.scheduler.hints import ComponentHints
from dask_kvstate.plugins.scheduler.sessions import SessionTracker
from dask_kvstate.protocol import BATCHING_WORKER_PLUGIN as BATCHING

FAST = {"kvstate.scheduling.interval": "20ms"}

_LOCK = threading.Lock()
RAN: list = []  # tags in the order tasks of a gen_cluster test ran (its workers share this process)
BATCHES: list[int] = []  # sizes of the batch calls made in this process


def run_check(tag, gate=None):
    if gate is not None:
        Event(gate).wait()
    with _LOCK:
        RAN.append(tag)
    return tag


def broken(tag):
    raise RuntimeError(f"tester {tag} failed")


def plain(x):
    return x + 1


@kvs.batchable
def classify(calls):
    """Batch contract: a list of argument tuples in, one result per tuple out."""
    with _LOCK:
        BATCHES.append(len(calls))
    out = []
    for text, *_ in calls:
        if text == "bad":
            raise ValueError(f"cannot classify {text!r}")
        out.append(f"{text}:{'code' if 'def' in text else 'chat'}")
    return out


async def install(c, components: dict, batch_window="0ms"):
    await c.register_plugin(SessionTracker())
    await c.register_plugin(ComponentHints(components, batch_window))


# -- validation ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "hint, match",
    [
        ({"tester": {"max-concurrency": 0}}, "tester.max-concurrency must be a positive int, got 0"),
        ({"tester": {"max-concurrency": -2}}, "tester.max-concurrency must be a positive int"),
        ({"tester": {"max-concurrency": True}}, "tester.max-concurrency must be a positive int, got True"),
        ({"tester": {"max-concurrency": "4"}}, "tester.max-concurrency must be a positive int, got '4'"),
        ({"router": {"batchable": "yes"}}, "router.batchable must be a bool"),
        ({"router": {"batchable": True, "max-batch": 0}}, "router.max-batch must be a positive int"),
        ({"router": {"max-batch": 4}}, "router.max-batch needs batchable: true"),
        ({"router": {"batch": True}}, r"router: unknown hint\(s\) \['batch'\]"),
    ],
)
def test_bad_hints_raise_value_error_naming_the_component(hint, match):
    with pytest.raises(ValueError, match=match):
        parse_hints(hint)
    with pytest.raises(ValueError, match=match):
        ComponentHints(hint)  # the extension's __init__: before anything reaches the cluster
    with dask.config.set({"kvstate.scheduling.components": hint}), pytest.raises(ValueError, match=match):
        kvs.install(None, model=False)  # fails while building the plugins: no client is touched


def test_config_check_accepts_hints_and_names_bad_ones():
    config.check({"scheduling": {"components": {"tester": {"max-concurrency": 2, "stateful": True}}}})
    with pytest.raises(ValueError, match="components.tester.max-concurrency must be >= 1"):
        config.check({"scheduling": {"components": {"tester": {"max-concurrency": 0}}}})
    with pytest.raises(ValueError, match="batch-window must be a duration"):
        ComponentHints({}, batch_window="soon")


def test_batchable_contract_outside_a_cluster():
    assert classify("def f(): pass") == "def f(): pass:code"  # a batch of one
    assert classify.run([("hi",), ("def g",)]) == ["hi:chat", "def g:code"]
    with pytest.raises(TypeError, match="positional arguments only"):
        classify(text="hi")
    bad = kvs.batchable(lambda calls: [1])
    with pytest.raises(ValueError, match="returned 1 results for 2 calls"):
        bad.run([(1,), (2,)])


# -- max-concurrency -----------------------------------------------------------------------
@gen_cluster(client=True, nthreads=[("", 2), ("", 2)], config=FAST)
async def test_max_concurrency_holds_excess_tasks_without_threads(c, s, a, b):
    await install(c, {"tester": {"max-concurrency": 2}})
    hints = s.plugins["kvstate-hints"]
    gate = Event("go")
    tests = c.map(run_check, range(8), gate="go", key=[f"tester-{i}" for i in range(8)])
    await async_poll_for(lambda: hints.stats()["held"]["tester"] == 6, timeout=10)
    assert hints.stats()["running"]["tester"] == 2
    assert sum(ts.state == "no-worker" for ts in s.tasks.values()) == 6
    # Two threads are free in the cluster: other work runs while six testers wait.
    assert await c.gather(c.map(plain, range(6))) == list(range(1, 7))
    assert hints.stats()["held"]["tester"] == 6
    await gate.set()
    assert sorted(await c.gather(tests)) == list(range(8))
    st = hints.stats()
    assert st["peak"] == {"tester": 2} and st["holds"] == st["releases"] == 6 and st["running"] == {"tester": 0}
    assert not hints.admitted and not hints.held_comp


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], config=FAST)
async def test_held_tasks_start_in_priority_order(c, s, a, b):
    RAN.clear()
    await install(c, {"tester": {"max-concurrency": 1}})
    hints = s.plugins["kvstate-hints"]
    with kvs.component("tester"):  # the annotation names the component (keys are free-form)
        first = c.submit(run_check, "first", "open", key="first")
        await async_poll_for(lambda: hints.stats()["running"]["tester"] == 1, timeout=10)
        low = c.submit(run_check, "low", key="low", priority=0)
        high = c.submit(run_check, "high", key="high", priority=10)
        mid = c.submit(run_check, "mid", key="mid", priority=5)
    await async_poll_for(lambda: hints.stats()["held"]["tester"] == 3, timeout=10)
    await Event("open").set()
    await c.gather([first, low, high, mid])
    assert RAN == ["first", "high", "mid", "low"]
    assert hints.stats()["peak"] == {"tester": 1}


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], config=FAST)
async def test_held_tasks_follow_revised_workflow_progress(c, s, a, b):
    from dask_kvstate.plugins.scheduler.priority import ProgressPriority

    RAN.clear()
    await c.register_plugin(SessionTracker())
    await c.register_plugin(ProgressPriority())
    await c.register_plugin(ComponentHints({"tester": {"max-concurrency": 1}}))
    hints, tracker = s.plugins["kvstate-hints"], s.plugins["kvstate-sessions"]
    with kvs.component("tester"):
        first = c.submit(run_check, "first", "open-progress", key="first")
        await async_poll_for(lambda: hints.stats()["running"]["tester"] == 1, timeout=10)
        with kvs.session("older", client=c):
            older = c.submit(run_check, "older", key="older")
        with kvs.session("busier", client=c) as busier:
            held = c.submit(run_check, "busier", key="busier")
    await async_poll_for(lambda: hints.stats()["held"]["tester"] == 2, timeout=10)
    assert s.tasks["older"].priority < s.tasks["busier"].priority  # equal progress: arrival order
    # The busier session completes other work (on the free thread): its progress passes the older one's.
    with dask.annotate(**{"kvstate-session": busier.id}):
        assert await c.gather(c.map(plain, range(3))) == [1, 2, 3]
    await async_poll_for(lambda: s.tasks["busier"].priority < s.tasks["older"].priority, timeout=10)
    await async_poll_for(lambda: hints.held["tester"].peek().key == "busier", timeout=10)  # re-keyed heap
    await Event("open-progress").set()
    await c.gather([first, older, held])
    assert RAN == ["first", "busier", "older"]
    assert tracker.sessions[busier.id].progress == 4


@gen_cluster(client=True, nthreads=[("", 2)], config=FAST)
async def test_released_and_failed_tasks_free_their_slots(c, s, a):
    # Two threads: a cancelled task keeps running in its thread until it returns (Dask
    # frees its slot on the scheduler at once, as it does for resources).
    await install(c, {"tester": {"max-concurrency": 1}})
    hints = s.plugins["kvstate-hints"]
    blocked = c.submit(run_check, "blocked", "never", key="tester-0")
    held = c.submit(run_check, "held", key="tester-1")
    await async_poll_for(lambda: hints.stats()["held"]["tester"] == 1, timeout=10)
    await c.cancel([blocked])  # processing -> released frees the slot; the held task starts
    assert await held == "held"
    boom = c.submit(broken, "x", key="tester-2")
    with pytest.raises(RuntimeError, match="tester x failed"):
        await boom
    assert await c.submit(run_check, "after", key="tester-3") == "after"
    await async_poll_for(lambda: hints.stats()["running"] == {"tester": 0}, timeout=10)
    await Event("never").set()


def counted(tag):
    """Counts running tasks cluster-wide (a Lock and Variables on the scheduler)."""
    with Lock("count"):
        n = Variable("running").get() + 1
        Variable("running").set(n)
        Variable("peak").set(max(n, Variable("peak").get()))
    Event("release").wait()
    with Lock("count"):
        Variable("running").set(Variable("running").get() - 1)
    return tag * 2


@pytest.mark.timeout(120)
def test_max_concurrency_is_cluster_wide_on_a_process_cluster():
    hints = {"tester": {"max-concurrency": 3}}
    with (
        dask.config.set({"kvstate.scheduling.components": hints, **FAST}),
        LocalCluster(n_workers=2, threads_per_worker=3, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        kvs.install(client, model=False)
        assert kvs.stats(client).scheduling["hints"]["installed"]
        Variable("running").set(0)
        Variable("peak").set(0)
        futures = client.map(counted, range(12), key=[f"tester-{i}" for i in range(12)])
        stats = lambda: kvs.stats(client).scheduling["hints"]
        from distributed.utils_test import poll_for

        poll_for(lambda: stats()["running"]["tester"] == 3 and stats()["held"]["tester"] == 9, timeout=30)
        poll_for(lambda: Variable("running").get() == 3, timeout=30)  # six threads, three of them in use
        Event("release").set()
        assert client.gather(futures) == [2 * i for i in range(12)]
        assert Variable("peak").get() == 3
        assert stats()["peak"] == {"tester": 3}


# -- batchable -------------------------------------------------------------------------------
def hold_thread(name):
    Event(name).wait()
    return name


async def _queue_behind_blocker(c, worker, n, **submit):
    """n classify tasks ready on ``worker`` behind a task holding its only thread."""
    blocker = c.submit(hold_thread, "unblock", key="blocker")
    await async_poll_for(
        lambda: "blocker" in worker.state.tasks and worker.state.tasks["blocker"].state == "executing", timeout=10
    )
    texts = [f"text {i}" if i % 2 else f"def f{i}()" for i in range(n)]
    futures = c.map(classify, texts, key=[f"classify-{i}" for i in range(n)], **submit)
    await async_poll_for(lambda: len(worker.state.ready) + len(worker.state.constrained) == n, timeout=10)
    await Event("unblock").set()
    await blocker
    return texts, futures


@gen_cluster(client=True, nthreads=[("", 1)], config=FAST)
async def test_batchable_tasks_ready_on_a_worker_run_as_one_call(c, s, a):
    BATCHES.clear()
    await install(c, {"classify": {"batchable": True}})
    await async_poll_for(lambda: BATCHING in a.plugins, timeout=10)
    texts, futures = await _queue_behind_blocker(c, a, 6)
    assert await c.gather(futures) == [f"{t}:{'code' if 'def' in t else 'chat'}" for t in texts]
    assert BATCHES == [6]  # one call for all six, not six calls
    st = a.plugins[BATCHING].stats()
    assert st["sizes"] == {6: 1} and st["followers"] == 5 and st["claims"] == 0


@gen_cluster(client=True, nthreads=[("", 1)], config=FAST)
async def test_max_batch_caps_the_batch(c, s, a):
    BATCHES.clear()
    await install(c, {"classify": {"batchable": True, "max-batch": 3}})
    await async_poll_for(lambda: BATCHING in a.plugins, timeout=10)
    _, futures = await _queue_behind_blocker(c, a, 7)
    assert len(await c.gather(futures)) == 7
    assert BATCHES == [3, 3, 1]


@gen_cluster(client=True, nthreads=[("", 1)], config=FAST)
async def test_an_error_in_one_element_fails_only_its_task(c, s, a):
    BATCHES.clear()
    await install(c, {"classify": {"batchable": True}})
    await async_poll_for(lambda: BATCHING in a.plugins, timeout=10)
    blocker = c.submit(hold_thread, "unblock2", key="blocker")
    await async_poll_for(
        lambda: "blocker" in a.state.tasks and a.state.tasks["blocker"].state == "executing", timeout=10
    )
    texts = ["hello", "bad", "def g()", "bye"]
    futures = c.map(classify, texts, key=[f"classify-{i}" for i in range(4)])
    await async_poll_for(lambda: len(a.state.ready) == 4, timeout=10)
    await Event("unblock2").set()
    await blocker
    results = await c.gather(futures, errors="skip")
    assert results == ["hello:chat", "def g():code", "bye:chat"]
    with pytest.raises(ValueError, match="cannot classify 'bad'"):
        await futures[1]
    assert BATCHES[0] == 4 and sorted(BATCHES[1:]) == [1, 1, 1, 1]  # the batch, then each alone
    assert a.plugins[BATCHING].stats()["split_batches"] == 1


@gen_cluster(client=True, nthreads=[("", 1)], config=FAST)
async def test_unhinted_batchable_runs_alone_and_dependencies_resolve(c, s, a):
    BATCHES.clear()
    await install(c, {"other": {"batchable": True}})  # the plugin is there, classify has no hint
    await async_poll_for(lambda: BATCHING in a.plugins, timeout=10)
    text = c.submit(str, "def h()", key="source")
    assert await c.submit(classify, text, key="classify-x") == "def h():code"  # a future as an argument
    assert BATCHES == [1]


class _ReadsFailAfter:
    """A worker's data as the batching plugin sees it: every read after the first ``ok`` raises."""

    def __init__(self, data, ok: int):
        self.data, self.ok = data, ok

    def __getitem__(self, key):
        self.ok -= 1
        if self.ok < 0:
            raise OSError(f"injected: {key} cannot be read back")
        return self.data[key]


class _WithData:
    """A worker whose ``data`` is replaced; everything else is the worker's own."""

    def __init__(self, worker, data):
        self._worker, self.data = worker, data

    def __getattr__(self, name):
        return getattr(self._worker, name)


@gen_cluster(client=True, nthreads=[("", 1)], config=FAST, timeout=60)
async def test_a_peer_whose_input_cannot_be_read_leaves_no_follower_waiting(c, s, a):
    """The leader claims a first peer, then reading a later peer's input raises: the claimed
    follower still gets its result from the batch, the unreadable one runs alone."""
    BATCHES.clear()
    await install(c, {"classify": {"batchable": True}})
    await async_poll_for(lambda: BATCHING in a.plugins, timeout=10)
    texts = ["hello", "def k()", "bye"]
    inputs = [c.submit(str, t, key=f"input-{i}") for i, t in enumerate(texts)]
    await c.gather(inputs)
    plugin = a.plugins[BATCHING]
    plugin.worker = _WithData(a, _ReadsFailAfter(a.data, ok=1))  # the second peer's input fails
    blocker = c.submit(hold_thread, "unblock3", key="blocker")
    await async_poll_for(
        lambda: "blocker" in a.state.tasks and a.state.tasks["blocker"].state == "executing", timeout=10
    )
    futures = [c.submit(classify, x, key=f"classify-{i}") for i, x in enumerate(inputs)]
    await async_poll_for(lambda: len(a.state.ready) == 3, timeout=10)
    await Event("unblock3").set()
    await blocker
    assert await c.gather(futures) == ["hello:chat", "def k():code", "bye:chat"]
    assert BATCHES == [2, 1]  # the leader with the peer it claimed, then the unreadable one alone
    assert plugin.stats()["claims"] == 0


def test_a_follower_whose_leader_is_gone_runs_alone(monkeypatch):
    from types import SimpleNamespace

    from dask_kvstate.plugins.worker import batching

    monkeypatch.setattr(batching, "_LEADER_CHECK_S", 0.01)
    plugin = batching.BatchingWorkerPlugin({"classify": None}, 0.0)
    plugin.setup(SimpleNamespace(state=SimpleNamespace(tasks={})))  # the leader's task is no more
    plugin.claims["classify-9"] = batching._Slot("classify-leader")
    assert plugin.run(classify, "classify-9", ("def z()",)) == "def z():code"
    assert plugin.stats()["orphaned_followers"] == 1
