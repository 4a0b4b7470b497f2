"""What ends a session, and that its end leaves no KV held on any worker.

A session ends by its close, by its client leaving (a client process killed with
SIGKILL inside ``kvs.session``), or by the idle limit; a worker whose lifecycle half goes
away (removed, or its worker closing) is asked nothing more and keeps no session hold.
Real tiny-llama workers, separate processes where the worker's side is under test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import dask
from distributed import Client, LocalCluster
from distributed.utils_test import poll_for

import dask_kvstate as kvs
from dask_kvstate.protocol import INVALIDATE, LIFECYCLE_EXTENSION, LIFECYCLE_WORKER_PLUGIN, SESSIONS_EXTENSION
from dask_kvstate.testing.footprint import worker_footprint

from .conftest import CONTEXT, TEST_CONFIG, on

LIFECYCLE = {**TEST_CONFIG, "kvstate.lifecycle.enabled": True, "kvstate.scheduling.interval": "50ms"}


def held(client) -> dict:
    """``{worker: bytes held for sessions}``."""
    return {w: f["session_bytes"] for w, f in client.run(worker_footprint).items()}


def session_view(sid, dask_scheduler=None) -> dict:
    """The tracker's record of ``sid``: open, or ended (and why), or unknown."""
    tracker = dask_scheduler.plugins[SESSIONS_EXTENSION]
    s = tracker.sessions.get(sid)
    if s is not None:
        return {"state": "open" if s.closed_at is None else "closing", **s.summary()}
    ended = [e for e in tracker.ended if e["id"] == sid]
    return {"state": "ended", **ended[0]} if ended else {"state": "unknown"}


def lifecycle_view(dask_scheduler=None) -> dict:
    ext = dask_scheduler.plugins[LIFECYCLE_EXTENSION]
    return {**ext.counters, "announced": sorted(ext.announced), "in_flight": sum(map(len, ext._calls.values()))}


def view_of(client, sid) -> dict:
    return client.run_on_scheduler(session_view, sid)


def stored(hashes, dask_worker=None) -> int:
    """How many of ``hashes`` (bytes or hex) the worker's store has, held or not."""
    store = dask_worker.plugins["kvstate"].runtime.store
    return sum((bytes.fromhex(h) if isinstance(h, str) else h) in store for h in hashes)


def invalidated(client, sid) -> set:
    """Workers that answered the invalidation of ``sid``."""
    return {m["worker"] for _, m in client.get_events("kvstate-lifecycle") if m.get("session") == sid}


async def remove_lifecycle_half(dask_worker=None):
    """What ``Worker.close`` does to each plugin first: remove it (teardown), the worker staying up."""
    await dask_worker.plugin_remove(LIFECYCLE_WORKER_PLUGIN)


async def add_lifecycle_half(dask_worker=None):
    from dask_kvstate.plugins.worker.lifecycle import KVLifecycleWorkerPlugin

    await dask_worker.plugin_add(KVLifecycleWorkerPlugin(), catch_errors=False)


def drop_the_handler(dask_worker=None) -> None:
    del dask_worker.handlers[INVALIDATE]


def discard(hashes, dask_worker=None) -> int:
    return dask_worker.plugins["kvstate"].runtime.store.discard(hashes)


def removals(dask_scheduler=None) -> int:
    """Sessions the tracker closed because their client left."""
    return dask_scheduler.plugins[SESSIONS_EXTENSION].counters["closed_by_client_removal"]


def no_handler_warnings(client, worker) -> list:
    return [msg for _, msg in client.get_worker_logs(workers=[worker])[worker] if "No handler" in msg]


def test_a_lifecycle_half_that_goes_is_asked_nothing_and_holds_nothing(client):
    """The half goes (here removed; a closing worker tears it down the same way) while the
    worker stays in the cluster: it says goodbye first, lets go of its session holds, and
    the session's end asks only the workers whose half is there."""
    c = client
    a, b = sorted(c.nthreads())
    with on(b), kvs.session("going") as s:
        f = c.compute(kvs.materialize("Going: " + CONTEXT))
        ref = f.result()
    assert held(c)[b] > 0
    before = c.run_on_scheduler(lifecycle_view)
    warned = len(no_handler_warnings(c, b))
    try:
        c.run(remove_lifecycle_half, workers=[b])
        assert c.run_on_scheduler(lifecycle_view)["announced"] == [a]  # the goodbye was answered first
        assert held(c)[b] == 0  # no plugin left to release them at the session's end
        assert c.run(stored, ref.blocks, workers=[b]) == {b: len(ref.blocks)}  # the live ref keeps its own
        del f
        poll_for(lambda: view_of(c, s.id)["state"] == "ended", timeout=20)
        poll_for(lambda: invalidated(c, s.id) == {a}, timeout=20)
        after = c.run_on_scheduler(lifecycle_view)
        assert after.get("invalidation_retries", 0) == before.get("invalidation_retries", 0)
        assert after.get("invalidations_unhandled", 0) == before.get("invalidations_unhandled", 0)
        assert len(no_handler_warnings(c, b)) == warned
    finally:
        c.run(add_lifecycle_half, workers=[b])
        # What the session left as plain cache there: the shared cluster goes on as it was.
        c.run(discard, ref.blocks, workers=[b])
    assert c.run_on_scheduler(lifecycle_view)["announced"] == [a, b]


def test_a_worker_without_the_handler_is_logged_once_not_retried(client):
    """A worker whose handler vanished without a goodbye answers as Dask does for an
    unknown RPC: the scheduler counts it, asks it nothing more, and does not retry."""
    c = client
    a, b = sorted(c.nthreads())
    before = c.run_on_scheduler(lifecycle_view)
    c.run(drop_the_handler, workers=[b])
    try:
        with on(b), kvs.session("deaf") as s:
            assert c.submit(len, "abc").result() == 3
        poll_for(lambda: c.run_on_scheduler(lifecycle_view)["announced"] == [a], timeout=20)
        poll_for(lambda: invalidated(c, s.id) == {a}, timeout=20)
        after = c.run_on_scheduler(lifecycle_view)
        assert after["invalidations_unhandled"] == before.get("invalidations_unhandled", 0) + 1
        assert after.get("invalidation_retries", 0) == before.get("invalidation_retries", 0)
        assert after["in_flight"] == 0
    finally:
        c.run(remove_lifecycle_half, workers=[b])  # no goodbye to say: b is off the list already
        c.run(add_lifecycle_half, workers=[b])
    assert c.run_on_scheduler(lifecycle_view)["announced"] == [a, b]


#: A client process that opens a session, leaves KV held on two workers, and waits to be killed.
KILLED_CLIENT = """
import json, sys
import dask
from distributed import Client
import dask_kvstate as kvs

address, a, b, context, config = sys.argv[1:6]
with dask.config.set(json.loads(config)):
    client = Client(address)
    with kvs.session("killed") as s:
        with dask.annotate(workers=[a], allow_other_workers=False):
            state = kvs.materialize(context)
        with dask.annotate(workers=[b], allow_other_workers=False):
            futures = client.compute([state, kvs.resume(state, " Pulled here.", max_new_tokens=2)])
        ref, _ = client.gather(futures)
        print(json.dumps({"session": s.id, "client": client.id, "blocks": [h.hex() for h in ref.blocks]}), flush=True)
        sys.stdin.read()  # inside the session, its futures held, until killed
"""


def test_a_killed_client_ends_its_session_and_its_kv_goes_everywhere(client):
    c = client
    a, b = sorted(c.nthreads())
    closed_before = c.run_on_scheduler(removals)
    args = [c.scheduler.address, a, b, "Killed: " + CONTEXT, json.dumps(TEST_CONFIG)]
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the client process exited with {proc.wait()}"
        seen = json.loads(line)
        view = view_of(c, seen["session"])
        assert view["state"] == "open" and view["owner"] == seen["client"]
        before = held(c)
        assert before[a] > 0 and before[b] > 0  # the state on a, its pulled replica on b
    finally:
        proc.kill()  # SIGKILL: no close notice, no release, the connection just drops
        proc.wait()
    poll_for(lambda: view_of(c, seen["session"])["state"] == "ended", timeout=30)
    assert view_of(c, seen["session"])["reason"] == "client-gone"
    poll_for(lambda: invalidated(c, seen["session"]) == {a, b}, timeout=20)
    assert held(c) == {a: 0, b: 0}
    assert c.run(stored, seen["blocks"]) == {a: 0, b: 0}  # nothing else held them: dropped, not cached
    assert c.run_on_scheduler(removals) == closed_before + 1


def run_tool(seconds, report):
    """A tool call of the workflow: takes time, no KV."""
    import time

    time.sleep(seconds)
    return report


def test_an_idle_session_ends_and_releases_its_kv_while_its_block_is_open():
    config = {**LIFECYCLE, "kvstate.scheduling.sessions.idle-timeout": "300ms"}
    with (
        dask.config.set(config),
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as c,
    ):
        kvs.install(c, "tiny-llama", torch_threads=1)
        (w,) = c.nthreads()
        with kvs.session("quiet") as s:
            # A call running past the limit is activity: the session stays until both are done.
            tool = c.submit(run_tool, 1.0, "ok")
            f = c.compute(kvs.materialize("Quiet: " + CONTEXT))
            assert tool.result() == "ok"
            ref = f.result()
            poll_for(lambda: view_of(c, s.id)["state"] == "ended", timeout=20)
            view = view_of(c, s.id)
            assert view["reason"] == "idle" and view["completed"] == view["created"] == 2  # after both calls
            poll_for(lambda: invalidated(c, s.id) == {w}, timeout=20)
            assert held(c) == {w: 0}
            # The future it still holds keeps its own ref's blocks, not the session's.
            assert c.run(stored, ref.blocks) == {w: len(ref.blocks)}
        del f, tool
        poll_for(lambda: c.run(stored, ref.blocks) == {w: 0}, timeout=20)
