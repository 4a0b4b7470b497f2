"""KV-aware placement and the transfer-versus-recompute rule on a live cluster."""

from __future__ import annotations

import dask
import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import poll_for

import dask_kvstate as kvs

from .conftest import CONTEXT, kv_cluster, on

AUTO = {"kvstate.block-tokens": 16, "kvstate.placement.rule": "auto"}


@pytest.fixture(params=["1 Mbit/s", None], ids=["slow-link", "loopback"])
def auto_client(request):
    cfg = {**AUTO, "kvstate.transport.emulated-bandwidth": request.param}
    with kv_cluster(cfg) as client:
        yield client, request.param


def test_worker_decides_with_measured_numbers_and_output_is_identical(auto_client):
    client, link = auto_client
    a, b = sorted(client.nthreads())
    text = "Rule test. " + CONTEXT * 3
    with on(a):
        state = kvs.materialize(text)
    with on(b):  # the user's restriction: the worker itself applies the rule
        outs = [kvs.resume(state, f" Question {i}?", max_new_tokens=8) for i in range(3)]
    got = dask.compute(*outs)
    want = dask.compute(*[kvs.generate(text, f" Question {i}?", max_new_tokens=8) for i in range(3)])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    s = kvs.stats(client).workers[b]
    choices = s.get("chose_pull", 0) + s.get("chose_recompute", 0)
    assert choices >= 1
    if link == "1 Mbit/s":  # ~100 KB of KV would take ~0.7 s; tiny-llama recomputes it in ms
        assert s.get("chose_recompute", 0) >= 1 and s.get("transfers", 0) == 0
    outcomes = [e for _, e in client.get_events("kvstate-placement") if e["kind"] == "outcome"]
    assert outcomes and all({"t_transfer", "t_recompute", "seconds", "action"} <= set(e) for e in outcomes)
    for e in outcomes:  # the rule took the option it estimated faster
        assert e["action"] == ("pull" if e["t_transfer"] < e["t_recompute"] else "recompute")


def test_scheduler_places_consumers_of_a_state(auto_client):
    client, _ = auto_client
    a, _ = sorted(client.nthreads())
    text = "Placement test. " + CONTEXT * 2
    with on(a):
        state = kvs.materialize(text)
    outs = [kvs.resume(s, f" Branch {i}:", max_new_tokens=6) for i, s in enumerate(kvs.fork(state, 2))]
    outs += [kvs.extend(state, " More context.")]
    got = dask.compute(*outs)
    want = [client.compute(kvs.generate(text, f" Branch {i}:", max_new_tokens=6)).result() for i in range(2)]
    assert [g.token_ids for g in got[:2]] == [w.token_ids for w in want]
    decisions = [e for _, e in client.get_events("kvstate-placement") if e["kind"] == "decision"]
    assert decisions, "the placement extension decided nothing"
    for d in decisions:
        assert {"worker", "action", "t_transfer", "t_recompute", "expected_start"} <= set(d)
    ps = kvs.stats(client).placement
    assert ps["installed"] and ps["decisions"] == len(decisions) and ps["workers"] == 2


def test_placement_can_be_switched_off():
    with dask.config.set({**AUTO, "kvstate.placement.enabled": False}):
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster:
            with Client(cluster) as client:
                kvs.install(client, "tiny-llama", torch_threads=1)
                assert kvs.stats(client).placement == {"installed": False}
                assert client.compute(kvs.generate("Still works.", max_new_tokens=2)).result().token_ids


@pytest.mark.skipif((__import__("os").cpu_count() or 1) < 2, reason="borrowing needs a second core")
def test_a_long_prefill_borrows_the_idle_workers_threads():
    """While one worker materializes, the other is idle: the prefill runs with its thread too."""
    with kv_cluster({**AUTO, "kvstate.worker.borrow-idle-threads": 16}) as client:
        a, b = sorted(client.nthreads())
        with on(a):
            state = kvs.materialize(CONTEXT)
            outs = [kvs.resume(state, f" Question {i}?", max_new_tokens=8) for i in range(2)]
        got = dask.compute(*outs)
        want = dask.compute(*[kvs.generate(CONTEXT, f" Question {i}?", max_new_tokens=8) for i in range(2)])
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert kvs.stats(client).workers[a].get("borrowed_threads", 0) >= 1
        # and gives them back
        assert client.run(lambda: __import__("torch").get_num_threads(), workers=[a])[a] == 1


@pytest.mark.skipif((__import__("os").cpu_count() or 1) < 2, reason="borrowing needs a second core")
def test_a_batch_of_siblings_decoding_on_the_holder_borrows_the_idle_workers_threads():
    """The siblings' batched decode is the critical path too: it runs with the idle worker's thread."""
    with kv_cluster({**AUTO, "kvstate.worker.borrow-idle-threads": 16}) as client:
        a, b = sorted(client.nthreads())
        text = "Batch test. " + CONTEXT
        with on(a):
            (state,) = dask.persist(kvs.materialize(text))  # its prefill borrows too: counted before the batch
            dask.compute(state)
            before = kvs.stats(client).workers[a].get("borrows", 0)
            got = dask.compute(*kvs.resume_many(state, [f" Question {i}?" for i in range(3)], max_new_tokens=8))
        want = dask.compute(*[kvs.generate(text, f" Question {i}?", max_new_tokens=8) for i in range(3)])
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert got[0].batch_rows == 3
        assert kvs.stats(client).workers[a].get("borrows", 0) == before + 1  # the batch's one borrow
        assert client.run(lambda: __import__("torch").get_num_threads(), workers=[a])[a] == 1


@pytest.mark.skipif((__import__("os").cpu_count() or 1) < 2, reason="borrowing needs a second core")
def test_a_long_prefill_on_a_lone_single_threaded_worker_borrows_the_cores_no_worker_claims():
    """One worker of one thread on a host of two or more cores: nothing of Dask's uses the
    other cores, so a long prefill runs on them too, and gives them back."""
    with kv_cluster({**AUTO, "kvstate.worker.borrow-idle-threads": 16}, n_workers=1) as client:
        (a,) = client.nthreads()
        cores = client.run(_cpu_count)[a]
        # the worker's count of cores reaches the scheduler with its first measurements
        poll_for(lambda: client.run_on_scheduler(_known_cores, worker=a) == cores, timeout=10)
        got = dask.compute(kvs.resume(kvs.materialize(CONTEXT), " Question?", max_new_tokens=8))
        # the model's own generate on the worker, at its one thread
        want = client.run(_model_generate, CONTEXT + " Question?", 8)[a]
        assert list(got[0].token_ids) == want[: len(got[0].token_ids)] and got[0].token_ids
        stats = kvs.stats(client).workers[a]
        assert stats.get("borrows", 0) >= 1 and stats.get("borrowed_threads", 0) >= 1
        assert client.run(lambda: __import__("torch").get_num_threads())[a] == 1
        # A session's first visit through the prefix cache fills the store as a materialize
        # does, in the one call: it borrows too; text replay, a baseline, does not.
        text = "First visit. " + CONTEXT
        (visit,) = dask.compute(kvs.generate(text, " Question?", max_new_tokens=8, prefix_cache=True))
        assert kvs.stats(client).workers[a]["borrows"] == stats["borrows"] + 1
        (replay,) = dask.compute(kvs.generate(text, " Question?", max_new_tokens=8))
        assert kvs.stats(client).workers[a]["borrows"] == stats["borrows"] + 1
        assert (
            list(visit.token_ids)
            == list(replay.token_ids)
            == client.run(_model_generate, text + " Question?", 8)[a][: len(replay.token_ids)]
        )
        # The session returns: its question reads the whole document from the store, and borrows.
        (back,) = dask.compute(kvs.generate(text, " Another question?", max_new_tokens=8, prefix_cache=True))
        assert back.reused_tokens > 0 and kvs.stats(client).workers[a]["borrows"] == stats["borrows"] + 2
        want = client.run(_model_generate, text + " Another question?", 8)[a]
        assert list(back.token_ids) == want[: len(back.token_ids)] and back.token_ids
        assert client.run(lambda: __import__("torch").get_num_threads())[a] == 1


def _cpu_count() -> int:
    from dask.system import CPU_COUNT

    return CPU_COUNT


def _known_cores(dask_scheduler, worker):
    from dask_kvstate.protocol import PLACEMENT_EXTENSION

    return dask_scheduler.plugins[PLACEMENT_EXTENSION].metrics.get(worker, {}).get("cores")


def _model_generate(text: str, n: int, dask_worker) -> list[int]:
    import torch

    from dask_kvstate.protocol import WORKER_PLUGIN

    backend = dask_worker.plugins[WORKER_PLUGIN].runtime.backend
    x = torch.tensor([backend.tokenize(text)])
    with torch.inference_mode():
        out = backend.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
    return out[0, x.shape[1] :].tolist()


def _two_long_resumes(client, tag: str):
    """Two resumes of one state held by worker a, checked against replay; their placement decisions.

    Both consume the state's own key, so one pass (its transition to memory) places both.
    """
    a, _ = sorted(client.nthreads())
    text = f"{tag} test. " + CONTEXT * 2
    with on(a):
        state = kvs.materialize(text)
    got = dask.compute(*[kvs.resume(state, f" Branch {i}:", max_new_tokens=4) for i in range(2)])
    want = [client.compute(kvs.generate(text, f" Branch {i}:", max_new_tokens=4)).result() for i in range(2)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    events = [e for _, e in client.get_events("kvstate-placement") if e["kind"] == "decision"]
    return [e for e in events if e["key"].startswith("kvs-resume-")]


# A prior of 60 s for a resume, through Dask's own ``default-task-durations``.
LONG_RESUMES = {**AUTO, "distributed.scheduler.default-task-durations": {"kvs-resume": "60s"}}


def test_consumers_placed_in_one_pass_spread_over_the_workers():
    """Dask counts a task in a worker's occupancy only once dispatched; placement counts its own picks.

    Two long resumes of one state: the first goes to the holder (nothing to move), the
    second to the other worker, because by then the holder is promised the first's
    expected duration.
    """
    with kv_cluster(LONG_RESUMES) as client:
        a, b = sorted(client.nthreads())
        client.run_on_scheduler(_count_asks)
        decisions = _two_long_resumes(client, "Spread")
        assert sorted(d["worker"] for d in decisions) == [a, b]
        on_b = next(d for d in decisions if d["worker"] == b)
        assert on_b["action"] in ("pull", "recompute") and on_b["expected_start"] < 60
        # The assignment carried what the worker needs: the state's copies, the idle threads
        # there; so the consumer on b moved its first byte without asking the scheduler.
        assert list(on_b["copies"]) == [a] and on_b["idle_threads"] >= 0
        assert client.run_on_scheduler(_count_asks) == {"holders": 0, "idle_threads": 0}
        outcomes = [e for _, e in client.get_events("kvstate-placement") if e["kind"] == "outcome"]
        (placed,) = [e for e in outcomes if e["worker"] == b]
        assert placed["by"] == "scheduler" and list(placed["holders"]) == [a] and placed["action"] == on_b["action"]


def _count_asks(dask_scheduler=None) -> dict | None:
    """Count the placement RPCs a worker may make (holders of blocks, idle threads) from
    now on; on the second call, how many there were."""
    from dask_kvstate.protocol import HOLDERS, IDLE_THREADS

    counts = getattr(dask_scheduler, "_kvstate_asks", None)
    if counts is not None:
        return dict(counts)
    counts = dask_scheduler._kvstate_asks = {"holders": 0, "idle_threads": 0}
    for op, name in ((HOLDERS, "holders"), (IDLE_THREADS, "idle_threads")):
        handler = dask_scheduler.handlers[op]

        def counted(*args, _handler=handler, _name=name, **kwargs):
            counts[_name] += 1
            return _handler(*args, **kwargs)

        dask_scheduler.handlers[op] = counted
    return None


def test_max_copies_keeps_consumers_on_the_holder():
    """The same two long resumes with ``placement.max-copies: 1``: both stay with the one copy."""
    with kv_cluster({**LONG_RESUMES, "kvstate.placement.max-copies": 1}) as client:
        a, b = sorted(client.nthreads())
        decisions = _two_long_resumes(client, "Copies")
        assert [d["worker"] for d in decisions] == [a, a] and all(d["capped"] for d in decisions)
        assert kvs.stats(client).workers[b].get("transfers", 0) == 0  # no second copy was made


def test_a_late_ref_report_leaves_no_placement_entry():
    """A report for a key already released or forgotten is dropped: no transition would ever remove it."""
    from types import SimpleNamespace

    from dask_kvstate.plugins.scheduler.placement import KVPlacement

    ext = KVPlacement()
    tasks = {key: SimpleNamespace(state=key, dependents=()) for key in ("released", "processing")}
    ext.scheduler = SimpleNamespace(tasks=tasks, log_event=lambda *args: None)
    summary = {
        "blocks": [b"h" * 16],
        "num_tokens": 16,
        "block_tokens": 16,
        "bytes_per_token": 8,
        "holder": "tcp://a",
        "model": "tiny-llama",
    }
    for key in ("forgotten", "released", "processing"):
        ext._on_ref(worker="tcp://a", key=key, refs=[summary])
    assert list(ext.refs) == ["processing"] and ext.counters["late_refs"] == 2
    ext.transition("processing", "processing", "erred")  # its task ended without a value
    assert ext.refs == {} and not ext.counters["errors"]


def _placed_on(worker, dask_scheduler=None) -> list:
    return sorted(dask_scheduler.plugins["kvstate-placement"].blocks_on.get(worker, ()))


def _drop_and_report(hashes, dask_worker=None) -> int:
    plugin = dask_worker.plugins["kvstate"]
    freed = plugin.runtime.store.discard(hashes)
    plugin.report_to_placement()
    return freed


def test_blocks_gone_before_the_next_block_report_leave_the_placement_extension():
    """A ref report adds its blocks to the holder's at once; they may go before the
    holder's next block report (released, then dropped for room or at a session's end).
    That report must still say they went, or the extension keeps them forever."""
    with kv_cluster({**AUTO, "kvstate.placement.report-interval": "1h"}) as client:  # reports only when told
        a, _ = sorted(client.nthreads())
        with on(a):
            future = client.compute(kvs.materialize("Gone before the report. " + CONTEXT))
        ref = future.result()
        assert set(ref.blocks) <= set(client.run_on_scheduler(_placed_on, a))  # the ref report's blocks
        del future
        poll_for(lambda: not client.run(lambda dask_worker: len(dask_worker.plugins["kvstate"].held))[a], timeout=10)
        assert client.run(_drop_and_report, ref.blocks, workers=[a])[a] > 0  # dropped, then a block report
        poll_for(lambda: not set(ref.blocks) & set(client.run_on_scheduler(_placed_on, a)), timeout=10)
