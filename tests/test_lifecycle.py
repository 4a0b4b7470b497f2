"""KV lifecycle by workflow progress on a real two-process tiny-llama cluster.

Invalidation at session end, session holds across invocations, offload and prefetch of
a suspended session's KV by the predicted idle time, and the pure rule with cases.
"""

from __future__ import annotations

import math
import time

import dask
import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import poll_for

import dask_kvstate as kvs
from dask_kvstate.plugins.scheduler.lifecycle_policy import (
    lifecycle_action,
    move_seconds,
    predict_idle,
    pressure_victims,
)
from dask_kvstate.protocol import INVALIDATE, LIFECYCLE_WORKER_PLUGIN

from .conftest import CONTEXT, TEST_CONFIG, on

BLOCK_TOKENS = TEST_CONFIG["kvstate.block-tokens"]
LIFECYCLE = {
    **TEST_CONFIG,
    "kvstate.lifecycle.enabled": True,
    "kvstate.scheduling.interval": "50ms",
    "kvstate.lifecycle.prefetch-margin": "200ms",
}


def run_tests(seconds, report):
    """A tool call (a test run) of the emulated developer workflow: takes time, no KV."""
    time.sleep(seconds)
    return report


@pytest.fixture(scope="module")
def lc_client():
    with (
        dask.config.set(LIFECYCLE),
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as c,
    ):
        kvs.install(c, "tiny-llama", torch_threads=1)
        yield c


def events(client, kind=None, phase=None, session=None):
    out = [m for _, m in client.get_events("kvstate-lifecycle")]
    return [
        m
        for m in out
        if (kind is None or m["kind"] == kind)
        and (phase is None or m.get("phase") == phase)
        and (session is None or m.get("session") == session)
    ]


def where(hashes, dask_worker=None):
    store = dask_worker.plugins["kvstate"].runtime.store
    return [store.where(h) for h in hashes]


def test_invalidation_leaves_zero_bytes_and_keeps_shared_blocks(lc_client):
    c = lc_client
    w = min(c.nthreads())
    with on(w):
        with kvs.session("a") as sa:
            fa = c.compute(kvs.extend(kvs.materialize(CONTEXT), " Session A keeps its own notes here. " * 3))
            ra = fa.result()
        with kvs.session("b") as sb:
            # Same text, another task (a pure task shared by two sessions keeps the first
            # one live until both are done): the blocks are shared by content, not by key.
            fb = c.compute(kvs.extend(kvs.materialize(CONTEXT[:50], CONTEXT[50:]), " Session B writes else. " * 3))
            rb = fb.result()
    shared = [h for h in ra.blocks if h in set(rb.blocks)]
    own_a = [h for h in ra.blocks if h not in set(rb.blocks)]
    assert shared and own_a
    assert None not in c.run(where, ra.blocks + rb.blocks, workers=[w])[w]

    del fa  # session a ends: its tasks are gone and its block has exited
    # Every worker is asked and logs its answer as it comes: wait for the holder's own.
    poll_for(lambda: [e for e in events(c, "invalidate", session=sa.id) if e["worker"] == w], timeout=20)
    (done,) = [e for e in events(c, "invalidate", session=sa.id) if e["worker"] == w]
    assert done["left"] == 0 and done["freed"] > 0
    # Shared: the blocks both final states hold, and the materialized context's last partial block.
    assert done["shared"] >= sum(
        c.run(
            lambda dask_worker: [dask_worker.plugins["kvstate"].runtime.store.size_of(h) for h in shared], workers=[w]
        )[w]
    )
    tiers = c.run(where, ra.blocks, workers=[w])[w]
    assert [tiers[ra.blocks.index(h)] for h in own_a] == [None] * len(own_a)  # a's own KV is gone
    assert None not in [tiers[ra.blocks.index(h)] for h in shared]  # b still lives and shares these

    del fb
    poll_for(lambda: [e for e in events(c, "invalidate", session=sb.id) if e["worker"] == w], timeout=20)
    assert c.run(where, ra.blocks + rb.blocks, workers=[w])[w] == [None] * len(ra.blocks + rb.blocks)
    left = c.run(lambda dask_worker: dask_worker.plugins[LIFECYCLE_WORKER_PLUGIN].stats()["sessions"])
    assert left == dict.fromkeys(left, 0)
    stats = kvs.stats(c).lifecycle
    assert stats["ended"][sb.id][w]["left"] == 0


def test_session_state_survives_between_invocations(lc_client):
    c = lc_client
    w = min(c.nthreads())
    text = CONTEXT + " The developer's conversation so far. "
    with on(w), kvs.session("dev"):
        f = c.compute(kvs.materialize(text))
        ref = f.result()
        del f  # the first invocation is over: no future holds the state any more
        # What a full disk or a cache clean-up does to unreferenced blocks:
        kept = c.run(lambda dask_worker: dask_worker.plugins["kvstate"].runtime.store.discard(ref.blocks), workers=[w])[
            w
        ]
        assert kept == 0  # nothing dropped: the session holds its states
        before = kvs.stats(c).workers[w]
        again = c.compute(kvs.resume(ref, " Try again.", max_new_tokens=4)).result()
        after = kvs.stats(c).workers[w]
    assert after.get("recomputes", 0) == before.get("recomputes", 0)
    assert after["reused_tokens"] - before.get("reused_tokens", 0) >= ref.num_tokens - 1
    assert again == c.compute(kvs.generate(text, " Try again.", max_new_tokens=4)).result()


def store_contents(dask_worker=None) -> set:
    store = dask_worker.plugins["kvstate"].runtime.store
    with store.lock:
        return {*store.device.d, *store.host.d, *store.disk.sizes}


def session_blocks(sid, dask_worker=None) -> set:
    return set(dask_worker.plugins[LIFECYCLE_WORKER_PLUGIN].sessions.by_session.get(sid, ()))


def test_a_session_holds_the_blocks_its_prefix_cached_answer_left(lc_client):
    """A conversation's next turn starts with the last prompt and its answer, whose KV the
    prefix cache keeps: the session holds every block the call stored, the answer's
    included, so the lifecycle keeps, offloads and prefetches them with the rest of its
    state instead of leaving them to the store's eviction."""
    c = lc_client
    w = min(c.nthreads())
    before = c.run(store_contents, workers=[w])[w]
    with on(w), kvs.session("chat") as s:
        chat = "A conversation of its own. " + CONTEXT  # no block another test stored
        first = c.compute(kvs.generate(chat, " First turn.", max_new_tokens=16, prefix_cache=True)).result()
        new = c.run(store_contents, workers=[w])[w] - before
        held = c.run(session_blocks, s.id, workers=[w])[w]
    # More blocks than the prompt's alone: the answer's tokens went past its last block.
    assert len(new) > math.ceil(first.prompt_tokens / BLOCK_TOKENS) and new <= held, (len(new), len(new - held))


def test_suspended_session_is_offloaded_then_prefetched(lc_client):
    c = lc_client
    w = sorted(c.nthreads())[1]
    with on(w):  # the first task unpickles this module on the worker (imports): kept out of
        # the tester's history, or its seconds would make it longer than the runs it predicts
        c.compute(dask.delayed(run_tests)(0.0, "import", dask_key_name="run_tests-import")).result()
    with on(w), kvs.component("tester"):  # history: the scheduler learns how long a test run takes
        c.compute(dask.delayed(run_tests)(1.0, "warm-up", dask_key_name="run_tests-history")).result()
    with on(w), kvs.session("swe") as s:
        f = c.compute(kvs.materialize(CONTEXT, " Write the function. "))
        ref = f.result()
        with kvs.component("tester"):
            report = dask.delayed(run_tests)(2.5, " 3 tests failed: fix the edge case.")
        resumed = c.compute(kvs.resume(ref, report, max_new_tokens=8))
        out = resumed.result()
        replay = c.compute(
            kvs.generate(CONTEXT, " Write the function. ", " 3 tests failed: fix the edge case.", max_new_tokens=8)
        ).result()
    assert out == replay  # resuming from offloaded-then-prefetched KV changes nothing

    # The events reach the scheduler on the worker's slowed timers: under a loaded host (the
    # whole suite on 2 cores) 20 s were once not enough; the poll ends as soon as they are in.
    poll_for(lambda: events(c, "prefetch", "done", s.id) and events(c, "prefetch", "outcome", s.id), timeout=60)
    (off,) = events(c, "offload", "decision", s.id)
    assert off["why"] == "prediction" and off["tier"] == "host"
    assert off["predicted_s"] > sum(off["costs"]["host"])  # it idles longer than moving out and back costs
    assert events(c, "offload", "done", s.id)[0]["blocks"] == len(ref.blocks)
    # The first prefetch comes from the prediction, before the task runs; one more may follow
    # when it runs (``why: running``), for lower-tier copies its report still shows.
    pre, *more = events(c, "prefetch", "decision", s.id)
    assert pre["why"] == "prediction" and all(m["why"] == "running" for m in more), [pre, *more]
    # Due back within the restore time plus the margin (0.2 s here, widened by the spread of
    # the tester's past durations, which the policy adds to it).
    # The rule prices a restore at its slowest tier (the blocks may lie in either).
    restore = max(cost[1] for cost in pre["costs"].values())
    assert pre["margin_s"] >= 0.2 and pre["predicted_s"] <= restore + pre["margin_s"] + 1e-9
    assert events(c, "prefetch", "done", s.id)[0]["blocks"] == len(ref.blocks)
    tiers = kvs.stats(c).workers[w]["tiers"]
    assert tiers["device"]["spills"] >= len(ref.blocks) and tiers["device"]["unspills"] >= len(ref.blocks)


def test_a_step_two_tool_calls_away_is_predicted_by_the_whole_chain(lc_client):
    """The session's next KV task waits on a tool call that waits on another: while the
    first runs, the prediction is both calls' means, not the second's alone."""
    c = lc_client
    w = sorted(c.nthreads())[0]
    with on(w):
        c.compute(dask.delayed(run_tests)(0.0, "import", dask_key_name="run_tests-import-chain")).result()
    with on(w), kvs.component("reviewer"):  # history: a review takes about 2 s
        c.compute(dask.delayed(run_tests)(2.0, "warm-up", dask_key_name="run_tests-review-history")).result()
    with on(w), kvs.session("review") as s:
        ref = c.compute(kvs.materialize(CONTEXT, " Review the patch. ")).result()
        with kvs.component("reviewer"):
            first = dask.delayed(run_tests)(2.0, " Style: fine.")
            second = dask.delayed(run_tests)(2.0, first)  # the second review reads the first
        out = c.compute(kvs.resume(ref, second, max_new_tokens=4)).result()
        replay = c.compute(kvs.generate(CONTEXT, " Review the patch. ", " Style: fine.", max_new_tokens=4)).result()
    assert out == replay
    poll_for(lambda: events(c, "prefetch", "decision", s.id), timeout=20)
    off = events(c, "offload", "decision", s.id)
    assert off and off[0]["why"] == "prediction", events(c, session=s.id)
    # Suspended while the first review runs: most of its 2 s left plus 2 s of the second
    # (the second's mean alone, 2 s at most, was the prediction before chains were
    # followed); a control pass up to 1.5 s late on a loaded machine still tells them apart.
    assert off[0]["predicted_s"] > 2.5, off[0]


def test_round_robin_sessions_come_back_from_disk_before_their_visits(tmp_path):
    """KV beyond the engine's memory, as one workflow (``beyond-memory``'s lifecycle row):
    six SmolLM2 sessions' documents do not fit the store's memory tiers, so each goes to
    disk between its visits, and the lifecycle brings it back up as the visit before
    its own runs. Every output equals transformers' ``generate`` of the whole prompt."""
    import torch

    from dask_kvstate.backends.models import load
    from dask_kvstate.bench import beyond_memory

    # ~300-token documents of ~14 MB of KV; tiers of 32 MiB each hold two and a bit.
    opts = beyond_memory.small(
        variants=["kvstate-lifecycle"],
        backends=["hf"],
        sessions=6,
        doc_tokens=300,
        memory_tier="32MiB",
        out=str(tmp_path),
    )
    with dask.config.set({"kvstate.block-tokens": 64, "kvstate.scheduling.interval": "50ms"}):
        res = beyond_memory.command(opts)
    (rows,) = res["rows"]["kvstate-lifecycle/hf"]
    model, tokenizer = load(opts.model)
    docs = beyond_memory.documents(opts.model, opts.sessions + 1, opts.doc_tokens)[:-1]
    for x in rows:
        ids = tokenizer(docs[x["session"]] + beyond_memory.question(x["session"], x["round"]), return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(ids.input_ids, max_new_tokens=opts.new_tokens, do_sample=False)
        assert x["token_ids"] == out[0, ids.input_ids.shape[1] :].tolist(), (x["session"], x["round"])
    back = [x for x in rows if x["round"] > 0]
    assert all(x["reused_tokens"] >= 256 for x in back)  # the document's whole blocks came from the store
    # The first follow-up has no history of its kind to be predicted from; after it, the
    # lifecycle fetches states ahead of their visits (every block the session holds, its
    # answer's too), keeps them up until the visit reads them, and such a visit reads no
    # block from disk. A visit that came earlier than its prediction's spread still may.
    ahead = [x for x in back if x["prefetched_blocks"]]
    clean = [x for x in ahead if x["tiers"] and "disk" not in x["tiers"]]
    assert ahead and 2 * len(clean) >= len(ahead), [(x["prefetched_blocks"], x["tiers"]) for x in back]
    assert "| kvstate-lifecycle/hf |" in (tmp_path / "beyond_memory.md").read_text()


# -- the pure rule -------------------------------------------------------------------------
COSTS = {"host": (0.01, 0.02), "disk": (0.1, 0.2)}


@pytest.mark.parametrize(
    "predicted, device, lower, host_room, expected",
    [
        (None, 100, 0, True, (None, None)),  # no history: no bet
        (1.0, 100, 0, True, ("offload", "host")),
        (1.0, 100, 0, False, ("offload", "disk")),  # host full
        (0.25, 100, 0, False, (None, None)),  # disk round trip 0.3 s + margin: not worth it
        (0.25, 100, 0, True, ("offload", "host")),
        (0.04, 100, 0, True, (None, None)),  # back before the move would pay
        (0.1, 0, 100, True, ("prefetch", None)),  # due within restore (0.2 worst tier) + margin
        (5.0, 0, 100, True, (None, None)),  # still far: stays out
        (0.0, 50, 50, True, ("prefetch", None)),  # partly out and due now
        (1.0, 0, 0, True, (None, None)),  # nothing stored
    ],
)
def test_lifecycle_action_cases(predicted, device, lower, host_room, expected):
    assert lifecycle_action(predicted, device, lower, COSTS, 0.05, host_room) == expected


def test_predict_idle_and_move_seconds():
    assert predict_idle([]) is None
    assert predict_idle([(1.0, 0.25), (3.0, 2.5), (2.0, 0.0)]) == 2.0
    assert predict_idle([(1.0, 2.0), (0.5, 0.6)]) == 0.0
    assert move_seconds(0, 1e6, 0.002) == 0.002
    assert move_seconds(2_000_000, 1e6, 0.0) == 2.0


def test_pressure_victims_longest_idle_first():
    idle = [(10.0, "recent", 500), (1.0, "oldest", 100), (4.0, "older", 300)]
    assert pressure_victims(idle, 50) == ["oldest"]
    assert pressure_victims(idle, 101) == ["oldest", "older"]
    assert pressure_victims(idle, 10_000) == ["oldest", "older", "recent"]  # all it can: the rest stays
    assert pressure_victims(idle, -5) == []  # the reserve is free already


# -- every replica goes at the session's end ------------------------------------------------
def session_bytes(hashes, dask_worker=None):
    """The store's bytes for ``hashes`` on one worker, whichever tier holds them."""
    store = dask_worker.plugins["kvstate"].runtime.store
    return sum(store.size_of(h) for h in hashes if h in store)


def test_session_end_drops_the_pulled_replica_too(lc_client):
    c = lc_client
    a, b = sorted(c.nthreads())
    text = "Replicas: " + CONTEXT + " Each fork answers one question."
    with kvs.session("replicas") as s:
        with on(a):
            state = kvs.materialize(text)
            forks = kvs.fork(state, 3)
            outs = [kvs.resume(f, f" Question {i}?", max_new_tokens=4) for i, f in enumerate(forks[:2])]
        with on(b):  # B holds none of it: it pulls the blocks from A
            outs.append(kvs.resume(forks[2], " Question 2?", max_new_tokens=4))
        futures = c.compute([state, *outs])
        ref, *answers = c.gather(futures)
    assert len(answers) == 3
    held = c.run(session_bytes, ref.blocks)
    assert held[a] > 0 and held[b] == held[a]  # B has its own replica
    pulled = kvs.stats(c).workers[b]
    assert pulled.get("transfers", 0) >= len(ref.blocks)

    del futures
    poll_for(lambda: len({e["worker"] for e in events(c, "invalidate", "done", s.id)}) == 2, timeout=20)
    answers_by_worker = {e["worker"]: e for e in events(c, "invalidate", "done", s.id)}
    assert answers_by_worker[b]["freed"] > 0 and answers_by_worker[b]["blocks"] >= len(ref.blocks)
    assert sum(c.run(session_bytes, ref.blocks).values()) == 0  # no byte of the session left anywhere


def held_blocks(hashes, dask_worker=None):
    """How many of ``hashes`` something (a ref, a session) holds on one worker."""
    return sum(h in dask_worker.plugins["kvstate"].runtime.store.holds for h in hashes)


def session_holds(dask_worker=None):
    """Sessions the worker's store holds blocks for."""
    return sorted({o[1] for o in dask_worker.plugins["kvstate"].runtime.store.holds.by_owner if o[0] == "session"})


def tracker_view(sid, dask_scheduler=None):
    tracker = dask_scheduler.plugins["kvstate-sessions"]
    return {"live": sid in tracker.sessions, "late_tasks": tracker.counters["late_tasks"]}


async def track_after_end(sid, hashes, dask_worker=None):
    """What a task of ``sid`` that outlived the session's end (cancelled, still running) leaves held."""
    lifecycle = dask_worker.plugins[LIFECYCLE_WORKER_PLUGIN]
    await lifecycle._invalidate(sessions=[sid])
    lifecycle._task_used(None, hashes)  # no task state: belongs to no session
    lifecycle._track(sid, hashes)
    return sid in session_holds(dask_worker)


def test_an_ended_session_stays_ended_when_a_late_graph_names_it(lc_client):
    c = lc_client
    a, _ = sorted(c.nthreads())
    with on(a), kvs.session("once") as s:
        f = c.compute(kvs.materialize("Once: " + CONTEXT))
        f.result()
        late = kvs.materialize("Late: " + CONTEXT)  # built in the session, computed after its end
    del f
    poll_for(lambda: {e["worker"] for e in events(c, "invalidate", "done", s.id)} == set(c.run(session_holds)), 20)
    before = c.run_on_scheduler(tracker_view, s.id)

    g = c.compute(late)
    ref = g.result()
    view = c.run_on_scheduler(tracker_view, s.id)
    assert not view["live"] and view["late_tasks"] > before["late_tasks"]  # not recreated
    assert all(s.id not in held for held in c.run(session_holds).values())  # no worker holds KV for it
    assert c.run(held_blocks, ref.blocks)[a] == len(ref.blocks)  # held by its future, as any state
    del g
    # Then by nothing: a prefix cache the store may drop, not a session's KV.
    poll_for(lambda: sum(c.run(held_blocks, ref.blocks).values()) == 0, timeout=20)
    # A task of the session that finishes after the end on a worker holds nothing either.
    assert c.run(track_after_end, s.id, list(ref.blocks), workers=[a]) == {a: False}


def stored(hashes, dask_worker=None) -> int:
    """How many of ``hashes`` the worker's store has, held or not."""
    return sum(h in dask_worker.plugins["kvstate"].runtime.store for h in hashes)


@pytest.mark.parametrize("slow", ["its own graph", "a graph ahead of it"])
def test_a_close_notice_that_overtakes_its_graph_does_not_end_the_session(lc_client, monkeypatch, slow):
    """``with kvs.session(): client.compute(...)`` then leaving the block: the close notice
    (an RPC) reaches the scheduler while the graph (on the client's stream) is still being
    built there, or still waits on the stream behind another graph being built. The
    session must wait for it: its tasks are the session's, and its KV goes when the
    session ends, not left behind as a prefix cache."""
    import distributed.scheduler

    c = lc_client
    a, _ = sorted(c.nthreads())
    build = distributed.scheduler._materialize_graph
    built: list = []

    def slow_build(*args, **kwargs):  # a busy scheduler, or a large graph: the notice wins by far
        if slow == "its own graph" or not built:
            time.sleep(1.0)
        built.append(1)
        return build(*args, **kwargs)

    before = c.run_on_scheduler(tracker_view, "none")["late_tasks"]
    monkeypatch.setattr(distributed.scheduler, "_materialize_graph", slow_build)  # the scheduler runs here
    ahead = c.compute(dask.delayed(sum)([1, 2])) if slow == "a graph ahead of it" else None
    with on(a), kvs.session("overtaken") as s:
        f = c.compute(kvs.materialize(f"Overtaken ({slow}): " + CONTEXT))
    ref = f.result()
    monkeypatch.undo()
    view = c.run_on_scheduler(tracker_view, s.id)
    assert view["late_tasks"] == before and view["live"]  # its task is the session's, and it is open
    assert s.id in c.run(session_holds)[a]
    del f, ahead
    poll_for(lambda: events(c, "invalidate", "done", s.id), timeout=20)
    poll_for(lambda: c.run(stored, ref.blocks)[a] == 0, timeout=20)  # the session's end took its KV


def fail_the_first_invalidation(dask_worker=None):
    original = dask_worker.handlers[INVALIDATE]
    calls: list = []

    async def flaky(sessions=()):
        calls.extend(sessions)  # the scheduler sends the sessions that ended together
        if len(calls) == 1:
            raise OSError("the worker is busy")
        return await original(sessions=sessions)

    dask_worker.handlers[INVALIDATE] = flaky
    dask_worker.kvstate_test_invalidations = calls


def restore_invalidation(dask_worker=None):
    dask_worker.handlers[INVALIDATE] = dask_worker.plugins[LIFECYCLE_WORKER_PLUGIN]._invalidate
    return dask_worker.kvstate_test_invalidations


def test_a_failed_invalidation_is_retried_until_the_worker_answers(lc_client):
    c = lc_client
    a, b = sorted(c.nthreads())
    c.run(fail_the_first_invalidation, workers=[b])
    retries = kvs.stats(c).lifecycle.get("invalidation_retries", 0)
    with kvs.session("flaky") as s:
        with on(a):
            state = kvs.materialize("Flaky: " + CONTEXT)
        with on(b):
            futures = c.compute([state, kvs.resume(state, " Pulled here.", max_new_tokens=2)])
        ref, _ = c.gather(futures)
    assert c.run(session_bytes, ref.blocks)[b] > 0
    del futures
    poll_for(lambda: {e["worker"] for e in events(c, "invalidate", "done", s.id)} == {a, b}, timeout=30)
    assert c.run(restore_invalidation, workers=[b])[b] == [s.id, s.id]  # failed once, then answered
    assert kvs.stats(c).lifecycle["invalidation_retries"] > retries
    assert sum(c.run(session_bytes, ref.blocks).values()) == 0


async def report_with_many_sessions(sessions, blocks, dask_worker=None):
    """The longest event-loop stall (s) while the lifecycle half reports ``sessions`` sharing ``blocks`` blocks."""
    import asyncio

    lifecycle = dask_worker.plugins[LIFECYCLE_WORKER_PLUGIN]
    shared = [i.to_bytes(32, "big") for i in range(blocks)]
    sids = [f"many-{i}" for i in range(sessions)]
    for sid in sids:
        lifecycle._track(sid, shared)
    longest, done, ticking = 0.0, False, asyncio.Event()

    async def ticks():  # a 2 ms tick: how late each one comes is how long the loop stalled
        nonlocal longest
        loop = asyncio.get_running_loop()
        while not done:
            t0 = loop.time()
            await asyncio.sleep(0.002)
            longest = max(longest, loop.time() - t0 - 0.002)
            ticking.set()

    ticker = asyncio.ensure_future(ticks())
    await ticking.wait()
    t0 = time.perf_counter()
    await lifecycle._report()
    seconds = time.perf_counter() - t0
    done = True
    await ticker
    await lifecycle._invalidate(sessions=sids)
    return longest, seconds


def test_the_lifecycle_report_stays_off_the_event_loop(lc_client):
    c = lc_client
    a, _ = sorted(c.nthreads())
    # 400 sessions x 400 shared blocks: 64 million set operations per report when every
    # session's own blocks are found by comparing it with every other one; on the loop,
    # that stalls every run. A loaded machine may starve one run too, so up to three run
    # (as in test_loop_latency) and the first one without a stall passes.
    runs = []
    for _ in range(3):
        runs.append(c.run(report_with_many_sessions, 400, 400, workers=[a])[a])
        if runs[-1][0] < 0.1:
            break
    assert runs[-1][0] < 0.1, runs  # (longest tick, report seconds) of each run


def invalidation_view(dask_scheduler=None):
    ext = dask_scheduler.plugins["kvstate-lifecycle"]
    return {**ext.counters, "pending": len(ext._invalidations), "announced": sorted(ext.announced)}


def test_a_failing_invalidation_stops_when_the_worker_leaves():
    from dask_kvstate.plugins.scheduler.lifecycle import KVLifecycle
    from dask_kvstate.plugins.scheduler.sessions import SessionTracker
    from dask_kvstate.plugins.worker.lifecycle import KVLifecycleWorkerPlugin

    config = {**LIFECYCLE, "distributed.comm.retry.delay.min": "20ms", "distributed.comm.retry.delay.max": "50ms"}
    with (
        dask.config.set(config),
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as c,
    ):
        for plugin in (SessionTracker(), KVLifecycle(), KVLifecycleWorkerPlugin()):
            c.register_plugin(plugin)
        a, b = sorted(cluster.workers.values(), key=lambda w: w.address)

        async def broken(session=None, sessions=None):
            raise OSError("the handler is broken")

        b.handlers[INVALIDATE] = broken
        with kvs.session("leaving") as s:
            assert c.submit(run_tests, 0.0, "ok").result() == "ok"
        poll_for(lambda: events(c, "invalidate", "done", s.id), timeout=10)  # a answered
        poll_for(lambda: c.run_on_scheduler(invalidation_view).get("invalidation_retries", 0) >= 2, timeout=10)
        c.retire_workers([b.address], close_workers=True)  # b goes, and its blocks with it
        poll_for(lambda: c.run_on_scheduler(invalidation_view)["pending"] == 0, timeout=10)
        view = c.run_on_scheduler(invalidation_view)
    assert view["invalidations_lost"] == 1 and view["announced"] == [a.address]


def test_the_wait_before_a_step_follows_the_longest_chain_and_gives_up_past_the_walk_limit():
    from types import SimpleNamespace

    from dask_kvstate.plugins.scheduler.lifecycle_history import WALK_LIMIT, TaskHistory, Walk

    history = TaskHistory()
    history.durations.update({"tool": [2, 2.0, 2.0], "review": [2, 4.0, 8.5]})  # means 1 s and 2 s (1.5 s, 2.5 s)

    def task(key, state="waiting", *deps):
        return SimpleNamespace(key=key, state=state, dependencies=list(deps), annotations=None)

    now = time.time()
    running = task("tool-0", "processing")
    history.started["tool-0"] = now - 0.25  # 0.75 s of it left
    short = task("tool-1", "waiting", running)  # then 1 s
    long = task("review-1", "waiting", task("review-0", "queued"))  # 2 s, then 2 s
    step = task("kvs-resume-1", "waiting", short, long)
    before, var = history.before_start(step, now, Walk())
    assert before == pytest.approx(4.0)  # the longer of 1.75 s and 4 s
    assert var == pytest.approx(2 * 0.5)  # two reviews' sample variances (runs of 1.5 s and 2.5 s), summed

    unseen = task("kvs-resume-2", "waiting", task("lint-0", "processing"))
    assert history.before_start(unseen, now, Walk()) is None  # a component never seen: no prediction

    chain = task("tool-x", "processing")
    for i in range(WALK_LIMIT + 1):
        chain = task(f"tool-{i + 10}", "waiting", chain)
    assert history.before_start(chain, now, Walk()) is None  # deeper than one pass walks: no prediction
    wide = task("tool-z", "waiting", *(task(f"tool-w{i}", "processing") for i in range(WALK_LIMIT)))
    assert history.before_start(wide, now, Walk()) is None  # so is a fan-in wider than that
    assert history.before_start(task("tool-y", "waiting", running), now, Walk()) == (
        pytest.approx(0.75),
        0.0,
    )  # next pass
