"""Workflow-aware scheduling (Nalar) on real in-process clusters: sessions, priority, stealing, capacity.

The clusters are ``gen_cluster`` ones (scheduler and workers in the test's event loop,
tasks in worker threads), so the tests read the scheduler's state directly; the
policies run exactly as on a process cluster.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time

import dask
import pytest
from distributed import Event, worker_client
from distributed.utils_test import async_poll_for, gen_cluster, poll_for

import dask_kvstate as kvs
from dask_kvstate.plugins.scheduler.capacity import CapacityController
from dask_kvstate.plugins.scheduler.priority import ProgressPriority, progress_priority
from dask_kvstate.plugins.scheduler.queueing import (
    against_the_move,
    congestion,
    expected_queue,
    peak_utilisation,
    queue_length,
    target_split,
    worth_moving,
)
from dask_kvstate.plugins.scheduler.sessions import SessionTracker
from dask_kvstate.plugins.scheduler.stealing import LateBindingStealing, migration_benefit
from dask_kvstate.plugins.worker.scheduling import SchedulingWorkerPlugin

FAST = {"kvstate.scheduling.interval": "20ms", "kvstate.scheduling.capacity.interval": "20ms"}

ORDER: list[str] = []  # tasks append their tag when they run (workers share this process)
_LOCK = threading.Lock()


def record(tag, *deps):
    with _LOCK:
        ORDER.append(tag)
    return tag


def blocker(name):
    Event(name).wait()
    return name


def nap(seconds, *deps):
    time.sleep(seconds)
    return seconds


def spawn(x):
    with worker_client() as c:
        return c.submit(nap, 0.0, x, pure=False).result()


async def install(c, *plugins):
    for p in (SessionTracker(), *plugins):
        await c.register_plugin(p)
    await c.register_plugin(SchedulingWorkerPlugin())


# -- kvs.install without a model -------------------------------------------------------
@gen_cluster(client=True, config=FAST)
async def test_install_under_an_asynchronous_client_takes_overrides_and_is_idempotent(c, s, a, b):
    from dask_kvstate.plugins.scheduler.placement import KVPlacement

    assert await kvs.install(c, model=False, scheduling={"priority": False}) == {}
    assert SessionTracker.name in s.plugins and LateBindingStealing.name in s.plugins  # on by default
    assert ProgressPriority.name not in s.plugins and KVPlacement.name not in s.plugins  # no model: no KV extensions
    assert all(SchedulingWorkerPlugin.name in w.plugins for w in (a, b))
    tracker = s.plugins[SessionTracker.name]
    await kvs.install(c, model=False, scheduling={"priority": False})
    assert s.plugins[SessionTracker.name] is tracker  # the second call reloaded nothing
    full = await kvs.stats(c)
    assert full.scheduling["stealing"]["installed"] and full.scheduling["priority"] == {"installed": False}
    assert full.workers[a.address] == {"installed": False} and full.placement == {"installed": False}


# -- sessions --------------------------------------------------------------------------
@gen_cluster(client=True, config=FAST)
async def test_session_tracks_progress_visits_and_fires_end_hook(c, s, a, b):
    await install(c)
    tracker = s.plugins["kvstate-sessions"]
    ended = []
    tracker.on_end.append(ended.append)
    with kvs.session("review", client=c) as sess:
        assert kvs.current_session() == sess.id
        fs = c.map(nap, [0.0] * 3, range(3))
        await c.gather(fs)
        total = await c.compute(dask.delayed(nap)(0.0, 9))
    assert total == 0.0
    live = tracker.sessions[sess.id]
    await async_poll_for(lambda: live.closed_at is not None, timeout=5)  # the notice is fire-and-forget
    assert live.ended_at is None  # closed, but its futures are still held
    assert live.completed == live.created == 4
    assert live.visits == {"nap": 4}

    del fs
    await async_poll_for(lambda: ended, timeout=5)
    assert [e.id for e in ended] == [sess.id]
    assert sess.id not in tracker.sessions
    kinds = [m["kind"] for _, m in s.get_events("kvstate-session") if m.get("session", m.get("id")) == sess.id]
    assert kinds[0] == "start" and kinds[-1] == "end"


@gen_cluster(client=True, config=FAST)
async def test_session_end_waits_for_released_futures_and_hook_errors_are_contained(c, s, a, b):
    await install(c)
    tracker = s.plugins["kvstate-sessions"]
    seen = []
    tracker.on_end.extend([lambda sess: 1 / 0, seen.append])  # a broken hook does not stop the next
    with kvs.session(client=c) as sess:
        f = c.submit(nap, 0.0, "x")
        await f
    await async_poll_for(lambda: tracker.sessions[sess.id].closed_at is not None, timeout=5)
    passes = tracker.loop.passes
    await async_poll_for(lambda: tracker.loop.passes >= passes + 3, timeout=5)  # still held: not ended
    assert not seen
    del f
    await async_poll_for(lambda: seen, timeout=5)
    assert seen[0].id == sess.id and seen[0].completed == 1


def _session_summary(sid, dask_scheduler):
    tracker = dask_scheduler.plugins["kvstate-sessions"]
    s = tracker.sessions.get(sid)
    return {**(s.summary() if s else {}), "inherited": tracker.counters["inherited_graphs"]}


def test_tasks_submitted_by_a_task_inherit_its_session():
    # A synchronous cluster (worker_client inside gen_cluster trips over other tests' global client).
    from distributed import Client, LocalCluster

    with (
        dask.config.set(FAST),
        LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        kvs.install(client, model=False)
        with kvs.session("parent", client=client) as sess:
            fut = client.submit(spawn, 1, pure=False)
            assert fut.result() == 0.0
        # The live future keeps the closed session from being swept (every 20 ms here) before it is read.
        info = client.run_on_scheduler(_session_summary, sess.id)
        del fut
    assert info["inherited"] == 1
    assert info["visits"] == {"spawn": 1, "nap": 1} and info["completed"] == 2


def test_session_rejects_a_bad_name():
    with pytest.raises(TypeError, match="session name"):
        with kvs.session(3):
            pass


# -- priority ------------------------------------------------------------------------------
def test_progress_priority_orders_by_progress_then_arrival_keeping_user_priority():
    fresh = progress_priority((0, 2, 0), progress=0, arrival=1.0)
    retry = progress_priority((0, 5, 3), progress=4, arrival=9.0)
    urgent = progress_priority((-1, 9, 9), progress=0, arrival=99.0)
    assert sorted([fresh, retry, urgent]) == [urgent, retry, fresh]
    again = progress_priority(retry, progress=5, arrival=9.0)  # revising keeps the stock tail
    assert again[-2:] == (5, 3) and len(again) == len(retry)


@gen_cluster(
    client=True,
    config=FAST,
    nthreads=[("127.0.0.1", 1, {"resources": {"role:x": 1}}), ("127.0.0.1", 1, {"resources": {"role:y": 1}})],
)
async def test_priority_resorts_a_workers_ready_queue_when_progress_changes(c, s, a, b):
    await install(c, ProgressPriority())
    ORDER.clear()
    gate = Event("gate-priority")
    x = {"role:x": 1}
    hold = c.submit(blocker, "gate-priority", resources=x)  # the role:x worker is busy
    await async_poll_for(lambda: a.state.executing_count == 1, timeout=5)
    with kvs.session("old", client=c) as old:  # arrives first: stock Dask runs its task first
        first = c.submit(record, "old", resources=x, pure=False)
    with kvs.session("busy", client=c) as busy:
        second = c.submit(record, "busy", resources=x, pure=False)
        # busy makes progress on the other worker while both wait on role:x
        await c.gather([c.submit(nap, 0.0, i, resources={"role:y": 1}, pure=False) for i in range(3)])
    tracker = s.plugins["kvstate-sessions"]
    assert tracker.sessions[busy.id].progress == 3 and tracker.sessions[old.id].progress == 0
    await async_poll_for(lambda: a.state.tasks[second.key].priority < a.state.tasks[first.key].priority, timeout=5)
    assert a.state.ready.peek().key == second.key if a.state.ready else a.state.constrained.peek().key == second.key
    await gate.set()
    await c.gather([hold, first, second])
    assert ORDER == ["busy", "old"]
    assert s.plugins["kvstate-priority"].counters["worker_revised"] >= 1


# -- stealing ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, moves",
    [
        ((8, 0, 4.0, 0.0, 0.0), True),  # idle thief, free move
        ((8, 7, 4.0, 3.5, 0.0), False),  # queues within alpha (12.5% < 20%)
        ((8, 0, 4.0, 0.0, 3.999), False),  # the KV bytes to move cost the whole gain (beta margin)
        ((0, 0, 0.0, 0.0, 0.0), False),  # nothing queued
        ((5, 0, 1.0, 2.0, 0.0), False),  # the thief's queue is longer in time than the victim's
    ],
)
def test_migration_benefit_cases(args, moves):
    assert (migration_benefit(*args, alpha=0.2, beta=1e-3) is not None) is moves


def test_stealing_settings_are_validated():
    with pytest.raises(ValueError, match="alpha"):
        LateBindingStealing(alpha=1.5)
    with pytest.raises(ValueError, match="beta"):
        LateBindingStealing(beta="soon")


@gen_cluster(
    client=True,
    config={
        **FAST,
        "distributed.scheduler.work-stealing": True,
        "distributed.scheduler.work-stealing-interval": "20ms",
    },
)
async def test_plain_tasks_are_balanced_by_dasks_own_stealing(c, s, a, b):
    await install(c, LateBindingStealing())
    stealing = s.plugins["kvstate-stealing"]
    assert "stealing" in s.periodic_callbacks  # Dask's balance, on its own timer
    # Everything lands on a (a loose restriction, as a KV placement would set); b is idle.
    fs = c.map(nap, [0.05] * 12, range(12), workers=[a.address], allow_other_workers=True)
    await c.gather(fs)
    ran_on_b = [f.key for f in fs if s.workers[b.address] in s.tasks[f.key].who_has]
    assert ran_on_b, "no task moved to the idle worker"
    assert stealing.stats()["fallback_requests"] >= len(ran_on_b)
    assert stealing.counters["moves"] == 0 and not stealing.owned  # none had KV, affinity or a cap


def _where(keys, dask_scheduler):
    return {k: dask_scheduler.tasks[k].state for k in keys if k in dask_scheduler.tasks}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=FAST)
async def test_session_tasks_are_late_bound_on_the_scheduler_queue(c, s, a):
    await install(c, LateBindingStealing())
    gate = c.submit(blocker, "gate-lb", pure=False)  # the only thread is busy
    await async_poll_for(lambda: gate.key in s.tasks and s.tasks[gate.key].state == "processing", timeout=5)
    with kvs.session("late", client=c):
        # Groups of one task each, as a workflow's calls are: never root-ish by Dask's rule.
        inside = [c.submit(nap, 0.0, i, key=k) for i, k in enumerate(("plan", "write", "check"))]
    outside = [c.submit(nap, 0.0, i, key=k) for i, k in enumerate(("alpha", "beta", "gamma"))]
    keys = [f.key for f in inside + outside]
    # Every task placed: on the worker (processing) or waiting in the scheduler's queue.
    await async_poll_for(
        lambda: all(getattr(s.tasks.get(k), "state", None) in ("processing", "queued") for k in keys), 5
    )
    states = _where(keys, s)
    await Event("gate-lb", client=c).set()
    await c.gather(inside + outside)
    # Beyond the worker's saturation slot, the session's calls wait on the scheduler; small
    # groups outside a session go to the worker's queue at once, as stock Dask sends them.
    assert [states[f.key] for f in inside].count("queued") >= 2, states
    assert all(states[f.key] == "processing" for f in outside), states


@gen_cluster(
    client=True,
    nthreads=[("127.0.0.1", 1)],
    config={**FAST, "kvstate.scheduling.stealing.continuation-wait": "2s"},
)
async def test_a_sessions_next_call_takes_the_thread_its_awaited_call_left(c, s, a):
    """The request awaits its call, then submits the next: that call gets the freed thread
    ahead of another session's calls queued earlier (without the kept slot it would
    run after all of them)."""
    await install(c, LateBindingStealing())
    ORDER.clear()
    with kvs.session("gatekeeper", client=c):  # the thread busy with session work: a full worker
        gate = c.submit(blocker, "gate-cont", pure=False)
    await async_poll_for(lambda: gate.key in s.tasks and s.tasks[gate.key].state == "processing", timeout=5)
    with kvs.session("ahead", client=c):
        first = c.submit(record, "first", key="first-call")
        await async_poll_for(lambda: getattr(s.tasks.get(first.key), "state", None) == "queued", timeout=5)
        with kvs.session("others", client=c):
            others = [c.submit(record, f"other-{i}", key=f"other-{i}") for i in range(4)]
        keys = [f.key for f in others]
        await async_poll_for(lambda: _where([f.key for f in others], s) == dict.fromkeys(keys, "queued"), timeout=5)
        await Event("gate-cont", client=c).set()
        await first  # a client round trip, as a workflow's ``await`` is
        second = c.submit(record, "second", first, key="second-call")
        await c.gather([second, *others])
    assert ORDER.index("second") == ORDER.index("first") + 1, ORDER
    late = s.plugins[LateBindingStealing.name].late
    assert late.counters["continuation_taken"] >= 1
    assert not late.kept and s.tasks[others[0].key].state == "memory"


@gen_cluster(
    client=True,
    nthreads=[("127.0.0.1", 1)],
    config={**FAST, "kvstate.scheduling.stealing.continuation-wait": "50ms"},
)
async def test_a_kept_thread_nobody_claims_goes_back_to_the_queue(c, s, a):
    await install(c, LateBindingStealing())
    with kvs.session("gatekeeper", client=c):
        gate = c.submit(blocker, "gate-exp", pure=False)
    await async_poll_for(lambda: gate.key in s.tasks and s.tasks[gate.key].state == "processing", timeout=5)
    with kvs.session("quiet", client=c):
        last = c.submit(nap, 0.0, "last", key="last-call")
        with kvs.session("busy", client=c):
            rest = [c.submit(nap, 0.0, i, key=f"rest-{i}") for i in range(3)]
        keys = [f.key for f in [last, *rest]]
        await async_poll_for(lambda: _where(keys, s) == dict.fromkeys(keys, "queued"), timeout=5)
        await Event("gate-exp", client=c).set()
        await c.gather([last, *rest])  # "quiet" never submits again: its kept thread expires
    late = s.plugins[LateBindingStealing.name].late
    assert late.counters["continuation_kept"] >= 1 and late.counters["continuation_expired"] >= 1
    assert not late.kept and a.address in {ws.address for ws in s.idle_task_count}


@gen_cluster(
    client=True,
    nthreads=[("127.0.0.1", 1)] * 2,
    config={**FAST, "kvstate.scheduling.stealing.late-binding-min-duration": 0},  # the naps take ~0 s
)
async def test_late_bound_tasks_run_where_their_inputs_are_when_that_thread_is_free(c, s, a, b):
    await install(c, LateBindingStealing())
    homes = [a.address, b.address] * 3
    inputs = [c.submit(nap, 0.0, i, workers=[w], key=f"input-{i}") for i, w in enumerate(homes)]
    await c.gather(inputs)
    uses = []
    for i, x in enumerate(inputs):  # one at a time: both threads free each time
        with kvs.session(f"user-{i}", client=c):
            uses.append(c.submit(nap, 0.0, x, key=f"use-{i}"))
            await uses[-1]
    ran = [next(iter(s.tasks[f.key].who_has)).address for f in uses]
    assert ran == homes
    assert s.plugins[LateBindingStealing.name].late.counters["placed_by_inputs"] == len(inputs)


@gen_cluster(client=True, config=FAST)
async def test_closing_the_extension_gives_the_scheduler_its_stock_dispatch_back(c, s, a, b):
    methods = ("check_idle_saturated", "stimulus_queue_slots_maybe_opened")
    await install(c, LateBindingStealing())
    assert all(m in s.__dict__ for m in methods)
    await s.plugins[LateBindingStealing.name].close()  # as the scheduler's close calls it
    assert not any(m in s.__dict__ for m in methods)
    assert all(f is type(s)._TRANSITIONS_TABLE[e] for e, f in s.__dict__.get("_TRANSITIONS_TABLE", {}).items())
    with kvs.session("after", client=c):
        assert await c.submit(nap, 0.0, 1, key="after-removal") == 0.0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=FAST)
async def test_session_tasks_known_to_be_short_are_left_to_stock_dask(c, s, a):
    """A thread idles a scheduler round trip between late-bound tasks: not worth it for
    calls measured below ``late-binding-min-duration``; calls not measured yet bind late."""
    await install(c, LateBindingStealing())
    late = s.plugins[LateBindingStealing.name].late
    with kvs.session("short", client=c):
        await c.submit(nap, 0.0, "warm", key="quick-0")  # the prefix's duration is measured: ~0 s
        gate = c.submit(blocker, "gate-short", key="long-wait")  # unknown duration (Dask assumes 0.5 s)
        quick = c.submit(nap, 0.0, 1, key="quick-1")
        await async_poll_for(lambda: all(k in s.tasks for k in (gate.key, quick.key)), timeout=5)
        decided = {f.key: late.binds_late(s.tasks[f.key]) for f in (gate, quick)}
        await Event("gate-short", client=c).set()
        await c.gather([gate, quick])
    assert decided == {"long-wait": True, "quick-1": False}


def test_late_binding_settings_are_validated():
    with pytest.raises(ValueError, match="continuation-wait"):
        LateBindingStealing(continuation_wait=-1)
    with pytest.raises(ValueError, match="late-binding"):
        LateBindingStealing(late_binding=-0.5)
    with pytest.raises(ValueError, match="late-binding-min-duration"):
        LateBindingStealing(late_binding_min_duration=-1)


@gen_cluster(client=True, config={**FAST, "distributed.scheduler.work-stealing": False})
async def test_with_dasks_stealing_off_plain_tasks_stay_put(c, s, a, b):
    await install(c, LateBindingStealing())
    fs = c.map(nap, [0.02] * 8, range(8), workers=[a.address], allow_other_workers=True)
    await c.gather(fs)
    assert all(s.workers[a.address] in s.tasks[f.key].who_has for f in fs)
    assert s.plugins["kvstate-stealing"].stats()["fallback_requests"] == 0
    assert "stealing" not in s.periodic_callbacks


@gen_cluster(
    client=True,
    config={
        **FAST,
        "distributed.scheduler.work-stealing": True,
        "kvstate.scheduling.components": {"nap": {"stateful": True}},
    },
)
async def test_stateful_component_keeps_session_affinity(c, s, a, b):
    await install(c, LateBindingStealing())
    with kvs.session("chat", client=c):
        first = c.submit(nap, 0.0, "turn-1", pure=False)
        await first
        home = next(iter(s.tasks[first.key].who_has)).address
        later = [c.submit(nap, 0.01, f"turn-{i}", pure=False) for i in range(2, 8)]
        await c.gather(later)
    assert {next(iter(s.tasks[f.key].who_has)).address for f in later} == {home}
    stealing = s.plugins["kvstate-stealing"]
    assert stealing.counters["affinity_routed"] == 6
    assert not stealing.stock.key_stealable  # Dask's stealing, on, never saw them


# -- capacity ------------------------------------------------------------------------------
def test_target_split_gives_overloaded_roles_units_first_within_limits():
    demand = {"plan": 0.2, "dev": 3.0, "test": 1.0}
    assert target_split(demand, 6, {}) == {"plan": 1, "dev": 3, "test": 2}
    assert target_split(demand, 6, {"dev": {"max": 2}}) == {"plan": 1, "dev": 2, "test": 3}
    assert target_split(demand, 6, {"test": {"min": 3}}) == {"plan": 1, "dev": 2, "test": 3}
    # An even tie keeps the split it has: no move for nothing.
    assert target_split({"a": 1.0, "b": 1.0}, 3, {}, current={"a": 1, "b": 2}) == {"a": 1, "b": 2}
    assert target_split({"a": 1.0, "b": 1.0}, 3, {}, current={"a": 2, "b": 1}) == {"a": 2, "b": 1}
    assert peak_utilisation(demand, {"plan": 1, "dev": 3, "test": 2}) == 1.0
    assert peak_utilisation({"a": 1.0}, {"a": 0}) == float("inf")


def test_queue_length_is_erlang_c():
    # M/M/2 at one Erlang: P0 = 1/3, Lq = P0 a^c rho / (c! (1 - rho)^2) = 1/3
    assert queue_length(2, 1.0) == pytest.approx(1 / 3)
    assert queue_length(1, 0.5) == pytest.approx(0.5)  # M/M/1: rho^2 / (1 - rho)
    assert queue_length(4, 4.0) == float("inf") and queue_length(4, 0.0) == 0.0
    # more units never lengthen the queue, and each further one helps less (convex: greedy is optimal)
    cuts = [queue_length(c, 4.3) - queue_length(c + 1, 4.3) for c in range(5, 10)]
    assert all(x > y > 0 for x, y in itertools.pairwise(cuts))


def test_target_split_keeps_a_second_unit_that_even_utilisation_would_take():
    # The analyst workflow's offered work, in a window where the summarizers' dipped
    # (0.82 units on average): even utilisation (Nalar's max-min x_v) now prefers 7 / 1
    # (61% / 60% against 72% / 30%), though one summarizer queues fifteen times as long as two.
    demand = {"analyst": 4.3, "summarizer": 0.6}
    six_two, seven_one = {"analyst": 6, "summarizer": 2}, {"analyst": 7, "summarizer": 1}
    assert peak_utilisation(demand, seven_one) < peak_utilisation(demand, six_two)
    assert queue_length(1, 0.6) > 10 * queue_length(2, 0.6)
    assert expected_queue(demand, seven_one) > expected_queue(demand, six_two)
    assert target_split(demand, 8, {}) == six_two
    assert target_split({"analyst": 4.3, "summarizer": 0.82}, 8, {}) == six_two
    # With a role overloaded whatever the split, the split evens utilisation (Nalar's).
    assert target_split({"a": 9.0, "b": 3.0}, 8, {}) == {"a": 6, "b": 2}


def test_a_burst_of_requests_does_not_move_a_unit_but_longer_calls_do():
    units = {"a": 6, "b": 2}
    # A window where 28 requests called both roles and their analyst calls piled up: a
    # looks overloaded on six units, and one more would even the load.
    burst = {"a": 7.0, "b": 0.71}
    target = target_split(burst, 8, {}, units)
    assert target == {"a": 7, "b": 1}
    assert worth_moving(congestion(burst, units), congestion(burst, target), 0.05)
    error = {v: d / math.sqrt(28) for v, d in burst.items()}
    doubt = against_the_move(burst, error, units, target, 2.0)
    assert doubt["a"] < burst["a"] and doubt["b"] > burst["b"]
    assert not worth_moving(congestion(doubt, units), congestion(doubt, target), 0.05)
    # The mix flips: b's calls got ten times longer. That is no burst: it moves at once.
    units, flipped = {"a": 7, "b": 1}, {"a": 0.5, "b": 4.8}
    target = target_split(flipped, 8, {}, units)
    assert target == {"a": 1, "b": 7}
    error = {v: d / math.sqrt(20) for v, d in flipped.items()}
    doubt = against_the_move(flipped, error, units, target, 2.0)
    assert worth_moving(congestion(doubt, units), congestion(doubt, target), 0.05)


def test_capacity_limits_are_validated():
    with pytest.raises(ValueError, match="max 1 < min 2"):
        CapacityController(limits={"role:dev": {"min": 2, "max": 1}})
    with pytest.raises(ValueError, match="roles are resources named"):
        CapacityController(limits={"dev": {"min": 1}})
    with pytest.raises(ValueError, match="window"):
        CapacityController(window="100ms")  # shorter than the 500ms interval
    with pytest.raises(ValueError, match="noise-sigmas=-1.0"):
        CapacityController(noise_sigmas=-1.0)


@gen_cluster(
    client=True,
    config=FAST,
    nthreads=[
        ("127.0.0.1", 1, {"resources": {"role:plan": 1}}),
        ("127.0.0.1", 1, {"resources": {"role:plan": 1}}),
        ("127.0.0.1", 1, {"resources": {"role:dev": 1}}),
    ],
)
async def test_capacity_moves_a_unit_to_a_persistent_bottleneck(c, s, p1, p2, dev):
    await install(c, CapacityController())
    dev_role = {"role:dev": 1}
    futures = []
    for i in range(6):  # six requests, each four developer calls: one developer unit is the bottleneck
        with kvs.session(f"req-{i}", client=c):
            futures += [c.submit(nap, 0.03, i, j, resources=dev_role, pure=False) for j in range(4)]
    capacity = s.plugins["kvstate-capacity"]
    await async_poll_for(lambda: capacity.counters["moves"] >= 1, timeout=10)
    move = capacity.moves[0]
    assert move["from"] == "role:plan" and move["to"] == "role:dev" and move["predicted_peak"] < move["peak"]
    moved = next(w for w in (p1, p2) if w.address == move["worker"])
    assert s.workers[moved.address].resources == {"role:plan": 0, "role:dev": 1}
    assert moved.state.total_resources == {"role:plan": 0, "role:dev": 1}  # the worker itself knows
    assert len(capacity.moves) == 1  # the target (1 planner, 2 developers) is reached in one move
    await c.gather(futures)
    # The new developer unit takes new developer work.
    more = c.map(nap, [0.02] * 6, range(6), resources=dev_role, pure=False)
    await c.gather(more)
    assert any(moved.address in {w.address for w in s.tasks[f.key].who_has} for f in more)
    assert not +capacity.processing_of  # counted by transitions, steals included: none left
    assert s.plugins["kvstate-sessions"].loop.stats()["capacity"]["count"] >= capacity.k


@gen_cluster(
    client=True,
    config=FAST,
    nthreads=[("127.0.0.1", 2, {"resources": {"role:dev": 1, "role:test": 1}})],
)
async def test_a_free_role_unit_is_not_blocked_by_a_task_waiting_for_another_role(c, s, a):
    # dask/distributed#6136: the worker used to stop at the first constrained task that does not fit.
    await install(c)
    assert type(a.state).__name__ == "_FirstFittingState"
    clog = c.submit(blocker, "clog-dev", resources={"role:dev": 1}, key="clog")
    waiting = c.submit(nap, 0.0, "dev", resources={"role:dev": 1}, key="dev-2", priority=10)
    await async_poll_for(lambda: len(a.state.tasks) >= 2, timeout=5)
    test = c.submit(nap, 0.0, "test", resources={"role:test": 1}, key="test-1")
    await asyncio.wait_for(test, 10)  # the tester unit is free, behind a higher-priority dev task
    assert a.state.tasks["dev-2"].state == "constrained"
    await Event("clog-dev", client=c).set()
    await c.gather([clog, waiting])


# -- KV in the move cost and in priority, with a real model ------------------------------------------
def _state_of(key, dask_scheduler):
    ts = dask_scheduler.tasks.get(key)
    return None if ts is None else ts.state


def _kv_view(consumer_key, a, b, dask_scheduler):
    ts = dask_scheduler.tasks[consumer_key]
    placement = dask_scheduler.plugins["kvstate-placement"]
    stealing = dask_scheduler.plugins["kvstate-stealing"]
    wa, wb = dask_scheduler.workers[a], dask_scheduler.workers[b]
    ref = next(placement.refs[d.key] for d in ts.dependencies if d.key in placement.refs)
    at_b = placement.estimate(ref, b)
    return {
        "state": ts.state,
        "on": ts.processing_on.address,
        "move_to_b": stealing._move_cost(ts, wa, wb),
        "inputs_to_b": dask_scheduler.get_comm_cost(ts, wb),
        "kv_at_b": min(at_b.t_transfer, at_b.t_recompute),
        "resident_a": ProgressPriority._resident(placement, ts, a),
        "resident_b": ProgressPriority._resident(placement, ts, b),
        "owned": ts in stealing.owned and ts not in stealing.stock.key_stealable,
    }


def test_kv_missing_at_the_thief_is_priced_into_the_move_and_residency_into_priority():
    from distributed import Client, LocalCluster
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401

    from dask_kvstate import tasks

    # Above: transformers resolves these names lazily, and two in-process workers loading
    # the model at once race on that first import; resolving them here first avoids it.
    from .conftest import CONTEXT

    cfg = {
        "kvstate.block-tokens": 16,
        "kvstate.transport.emulated-bandwidth": "1 Mbit/s",
        "kvstate.scheduling.stealing.enabled": True,
        "kvstate.scheduling.priority.enabled": True,
        "kvstate.scheduling.priority.kv-resident": True,
        "kvstate.scheduling.stealing.beta": "1h",
    }  # (price moves, make none: the consumer stays put)
    with dask.config.set(cfg):
        with (
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
            Client(cluster) as client,
        ):
            kvs.install(client, "tiny-llama", torch_threads=1)
            a, b = sorted(client.nthreads())
            state = client.submit(tasks.materialize, "Move cost. " + CONTEXT * 2, workers=[a], pure=False)
            state.result()
            hold = client.submit(blocker, "gate-kv", workers=[a], pure=False)  # a is busy: the consumer queues
            consumer = client.submit(
                tasks.resume, state, " Next?", max_new_tokens=2, workers=[a], allow_other_workers=True, pure=False
            )
            poll_for(lambda: client.run_on_scheduler(_state_of, consumer.key) == "processing", timeout=30)
            view = client.run_on_scheduler(_kv_view, consumer.key, a, b)
            Event("gate-kv", client=client).set()
            assert consumer.result().token_ids and hold.result() == "gate-kv"
    assert view["on"] == a
    assert view["kv_at_b"] > 0  # the blocks are on a only; b would pull or recompute them
    assert view["move_to_b"] >= view["inputs_to_b"] + view["kv_at_b"] - 1e-9
    assert view["resident_a"] and not view["resident_b"]
    assert view["owned"]  # a KV consumer: priced by the KV-aware policy, never by Dask's stealing
