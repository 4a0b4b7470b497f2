"""Faults on a real process cluster: a holder killed mid-workflow, a block pull broken
mid-stream, the scheduler extension failing. Every output still arrives and equals
text replay token for token.

One small cluster for this module (not the session one): these tests kill workers.
"""

from __future__ import annotations

import logging
import os

import dask
import pytest
from distributed import wait
from distributed.utils_test import async_poll_for, poll_for

import dask_kvstate as kvs
from dask_kvstate.protocol import GET_BLOCKS

from .conftest import CONTEXT, kv_cluster, on
from .test_failures import FAST_FAIL, kill

QUESTION = " Who tests the code?"


@pytest.fixture(scope="module")
def fault_client():
    with kv_cluster(FAST_FAIL) as client:
        yield client


def replay(client, *segments, n=12):
    return client.compute(kvs.generate(*segments, max_new_tokens=n)).result()


def total(client, counter: str) -> int:
    return sum(s.get(counter, 0) for s in kvs.stats(client).workers.values())


# -- the scheduler extension fails ---------------------------------------------------
def _break_placement(dask_scheduler):
    def boom(*args, **kwargs):
        raise RuntimeError("injected placement failure")

    ext = dask_scheduler.plugins["kvstate-placement"]
    ext.estimate = ext.holders = boom  # every decision now raises (in transition)
    ext.blocks_on = None  # and every block report from a worker (a stream handler)


def _mend_placement(dask_scheduler):
    ext = dask_scheduler.plugins["kvstate-placement"]
    vars(ext).pop("estimate", None)
    vars(ext).pop("holders", None)
    ext.blocks_on = {}


def test_placement_failure_is_logged_and_tasks_keep_running(fault_client, caplog):
    client = fault_client
    workers = sorted(client.nthreads())
    text = "Placement. " + CONTEXT
    state = kvs.materialize(text)
    dask.compute(*[kvs.resume(s, f" Q{i}?", max_new_tokens=8) for i, s in enumerate(kvs.fork(state, 3))])
    before = kvs.stats(client).placement
    assert before.get("decisions", 0) > 0 and before.get("errors", 0) == 0

    client.run_on_scheduler(_break_placement)
    try:
        with caplog.at_level(logging.ERROR, logger="dask_kvstate"):  # the scheduler runs in this process
            state = kvs.materialize("After the failure. " + CONTEXT)
            outs = dask.compute(*[kvs.resume(s, f" Q{i}?", max_new_tokens=8) for i, s in enumerate(kvs.fork(state, 3))])
        after = kvs.stats(client).placement
    finally:
        client.run_on_scheduler(_mend_placement)
    want = [replay(client, "After the failure. " + CONTEXT, f" Q{i}?", n=8) for i in range(3)]
    print(
        f"placement failing: {after['errors']} errors logged, decisions {before['decisions']} -> "
        f"{after['decisions']}, {sum(o.token_ids == w.token_ids for o, w in zip(outs, want))}/3 identical"
    )
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    assert after["errors"] >= 1 and after["decisions"] == before["decisions"]  # no new decision, no crash
    assert sorted(client.nthreads()) == workers  # no worker lost its stream
    events = [e for _, e in client.get_events("kvstate-error")]
    assert {e["where"] for e in events} >= {"a transition", "a ref report"}  # a hook and a stream handler
    assert any("injected placement failure" in e["error"] for e in events)
    assert any("kvstate placement" in r.getMessage() and r.exc_info for r in caplog.records)


# -- a block pull breaks mid-stream ----------------------------------------------------
async def _serve_half_then(dask_worker, how: str):
    """Make this worker's block handler write half of its reply, then abort the comm or die."""
    from distributed.comm.core import CommClosedError
    from distributed.comm.tcp import _add_frames_header
    from distributed.comm.utils import to_frames

    serve = dask_worker.handlers[GET_BLOCKS]

    async def broken(comm=None, hashes=()):
        reply = await serve(comm=comm, hashes=hashes)
        frames = await to_frames(
            reply, context={"sender": comm.local_info, "recipient": comm.remote_info, **comm.handshake_options}
        )
        frames, _, _ = _add_frames_header(frames)
        wire = b"".join(bytes(f) for f in frames)
        await comm.stream.write(wire[: len(wire) // 2])  # on the socket: the reader has half a message
        dask_worker._kvstate_half_sent = len(wire) // 2
        if how == "die":
            os._exit(1)
        comm.abort()
        dask_worker.handlers[GET_BLOCKS] = serve  # once
        raise CommClosedError("aborted mid-reply (test)")

    dask_worker.handlers[GET_BLOCKS] = broken


def _blocks_here(dask_worker) -> list:
    return list(dask_worker.plugins["kvstate"].runtime.store)


@pytest.mark.parametrize("how", ["abort", "die"])
def test_block_pull_broken_mid_stream_uses_no_partial_block(fault_client, how):
    client = fault_client
    a, b = sorted(client.nthreads())
    text = f"Midstream {how}. " + CONTEXT
    with on(a):
        state = client.persist(kvs.materialize(text))
    ref = state.compute()
    assert ref.placement.worker == a and len(ref.blocks) >= 4
    client.run(_serve_half_then, how=how, workers=[a])
    before = kvs.stats(client).workers[b]
    with on(b):
        out = client.compute(kvs.resume(state, QUESTION, max_new_tokens=12)).result()
    if how == "die":
        poll_for(lambda: a not in client.nthreads(), timeout=30)
        client.wait_for_workers(2, timeout=60)
    s = kvs.stats(client).workers[b]
    print(
        f"pull broken mid-stream ({how}): {len(ref.blocks)} blocks asked, transfer failures "
        f"+{s.get('transfer_failures', 0) - before.get('transfer_failures', 0)}, blocks kept from the reply "
        f"{s.get('transfers', 0) - before.get('transfers', 0)}, recomputed {s['recomputes'] - before.get('recomputes', 0)}"
    )
    assert out.token_ids == replay(client, text, QUESTION).token_ids
    assert s.get("transfer_failures", 0) == before.get("transfer_failures", 0) + 1
    assert s.get("transfers", 0) == before.get("transfers", 0)  # not one block of the broken reply kept
    assert s["recomputes"] - before.get("recomputes", 0) == len(ref.blocks)  # every block rebuilt here
    assert set(ref.blocks) <= set(client.run(_blocks_here, workers=[b])[b])


# -- a frame corrupted on the way, a block of the wrong shape ---------------------------
def _holder_checksums(dask_worker, on: bool) -> None:
    import dataclasses

    plugin = dask_worker.plugins["kvstate"]
    plugin.worker_settings = dataclasses.replace(plugin.worker_settings, checksum=on)


async def _flip_a_byte_of_the_next_reply(dask_worker):
    """Make this worker's next block reply carry one flipped byte (in a copy: its own blocks stay right)."""
    import numpy as np
    from distributed.protocol import to_serialize

    serve = dask_worker.handlers[GET_BLOCKS]

    async def corrupting(comm=None, hashes=(), **kwargs):
        reply = await serve(comm=comm, hashes=hashes, **kwargs)
        frame = np.array(reply["frames"][0].data, dtype=np.uint8).reshape(-1)  # a copy
        frame[frame.nbytes // 2] ^= 0x10
        dask_worker.handlers[GET_BLOCKS] = serve  # once
        return {**reply, "frames": [to_serialize(frame)]}

    dask_worker.handlers[GET_BLOCKS] = corrupting


def test_a_corrupted_frame_is_caught_by_its_checksum_and_recomputed(fault_client):
    client = fault_client
    a, b = sorted(client.nthreads())
    client.run(_holder_checksums, on=True, workers=[a])
    try:
        text = "A flipped byte. " + CONTEXT
        with on(a):
            state = client.persist(kvs.materialize(text))
        ref = state.compute()
        client.run(_flip_a_byte_of_the_next_reply, workers=[a])
        before = kvs.stats(client).workers[b]
        with on(b):
            out = client.compute(kvs.resume(state, QUESTION, max_new_tokens=12)).result()
        s = kvs.stats(client).workers[b]
        # The next pull, unharmed, passes its checks.
        clean_text = "An intact frame. " + CONTEXT
        with on(a):
            clean = client.persist(kvs.materialize(clean_text))
        clean_blocks = len(clean.compute().blocks)
        with on(b):
            clean_out = client.compute(kvs.resume(clean, QUESTION, max_new_tokens=12)).result()
        after = kvs.stats(client).workers[b]
    finally:
        client.run(_holder_checksums, on=False, workers=[a])

    def delta(stats, old, key):
        return stats.get(key, 0) - old.get(key, 0)

    print(
        f"corrupted frame: checksum failures +{delta(s, before, 'pull_checksum_failures')}, blocks kept from it "
        f"{delta(s, before, 'transfers')}, recomputed {delta(s, before, 'recomputes')}; the next pull kept "
        f"{delta(after, s, 'transfers')} blocks"
    )
    assert out.token_ids == replay(client, text, QUESTION).token_ids
    assert delta(s, before, "pull_checksum_failures") == 1 and delta(s, before, "transfer_failures") == 1
    assert delta(s, before, "transfers") == 0  # not one block of the damaged reply kept
    assert delta(s, before, "recomputes") == len(ref.blocks)
    assert clean_out.token_ids == replay(client, clean_text, QUESTION).token_ids
    assert delta(after, s, "pull_checksum_failures") == 0 and delta(after, s, "transfers") == clean_blocks


async def _spoil_the_next_probe_reply(dask_worker, how: str, probe_blocks: int):
    """Make this worker's next reply to a pull of ``probe_blocks`` blocks (a first probe)
    carry a flipped byte (``corrupted``) or a layout no puller can read (``malformed``);
    record the size of every pull it is asked for, as it arrives."""
    import numpy as np
    from distributed.protocol import to_serialize

    serve = dask_worker.handlers[GET_BLOCKS]
    dask_worker._kvstate_asked = asked = []

    async def spoiling(comm=None, hashes=(), **kwargs):
        asked.append(len(hashes))
        reply = await serve(comm=comm, hashes=hashes, **kwargs)
        if len(hashes) != probe_blocks or dask_worker.handlers[GET_BLOCKS] is not spoiling:
            return reply
        dask_worker.handlers[GET_BLOCKS] = serve  # once
        if how == "malformed":
            return {**reply, "arena": ["float32", "no shape", [], []]}
        frame = np.array(reply["frames"][0].data, dtype=np.uint8).reshape(-1)  # a copy
        frame[frame.nbytes // 2] ^= 0x10
        return {**reply, "frames": [to_serialize(frame)]}

    dask_worker.handlers[GET_BLOCKS] = spoiling


def _pulls_asked(dask_worker) -> list:
    return dask_worker._kvstate_asked


def _probe_first(dask_worker, holder: str, on: bool, probe_bytes: int) -> None:
    """The measured rule with ``probe_bytes`` probes here, ``holder``'s link not measured yet,
    and prefill timed as slow (a model much larger than tiny-llama), so the rule pulls and
    its first contact with the link is a probe; or back to what was there."""
    import dataclasses

    from dask_kvstate.plugins.worker.measure import PrefillMeter

    rt = dask_worker.plugins["kvstate"].runtime
    if on:
        dask_worker._kvstate_saved = rt.settings, rt.prefill_meter
        slow = PrefillMeter()
        slow.add(32, 0, 1.0)
        slow.add(256, 0, 8.0)
        rt.settings, rt.prefill_meter = dataclasses.replace(rt.settings, rule="auto", probe_bytes=probe_bytes), slow
        rt.links.forget(holder)
    else:
        rt.settings, rt.prefill_meter = dask_worker._kvstate_saved


@pytest.mark.parametrize("how", ["corrupted", "malformed"])
def test_a_bad_first_probe_reply_is_a_recompute(fault_client, how):
    client = fault_client
    a, b = sorted(client.nthreads())
    block_bytes = client.run(_block_bytes, workers=[b])[b]
    text = f"A {how} probe. " + CONTEXT
    with on(a):
        state = client.persist(kvs.materialize(text))
    ref = state.compute()
    # a probe of one block, the rest asked for beside it: the rule's first contact with a link
    assert len(ref.blocks) > 4
    client.run(_holder_checksums, on=True, workers=[a])
    client.run(_probe_first, holder=a, on=True, probe_bytes=block_bytes, workers=[b])
    try:
        client.run(_spoil_the_next_probe_reply, how=how, probe_blocks=1, workers=[a])
        before = kvs.stats(client).workers[b]
        with on(b):
            out = client.compute(kvs.resume(state, QUESTION, max_new_tokens=12)).result()
        s = kvs.stats(client).workers[b]
        asked = client.run(_pulls_asked, workers=[a])[a]
    finally:
        client.run(_probe_first, holder=a, on=False, probe_bytes=0, workers=[b])
        client.run(_holder_checksums, on=False, workers=[a])

    def delta(key):
        return s.get(key, 0) - before.get(key, 0)

    print(
        f"{how} first probe reply: pulls asked {asked}, transfer failures +{delta('transfer_failures')}, "
        f"checksum failures +{delta('pull_checksum_failures')}, cut off +{delta('pulls_cut_off')}, blocks kept {delta('transfers')}, "
        f"recomputed {delta('recomputes')} of {len(ref.blocks)}"
    )
    # the probe; the rest, asked for beside it, reaches the holder (in either order: two
    # comms) unless it was cancelled first
    assert 1 in asked and set(asked) <= {1, len(ref.blocks) - 1}
    assert out.token_ids == replay(client, text, QUESTION).token_ids
    assert delta("transfer_failures") == 1
    assert delta("pull_checksum_failures") == (how == "corrupted")
    assert delta("transfers") == 0  # nothing of the bad reply, nor of the rest beside it, kept
    assert delta("recomputes") == len(ref.blocks)


def _block_bytes(dask_worker) -> int:
    rt = dask_worker.plugins["kvstate"].runtime
    return rt.block_tokens * rt.backend.kv_bytes_per_token


def _reshape_a_held_block(dask_worker, h: bytes) -> list:
    """Put a block one token short under hash ``h`` in this worker's store; its shape, as a list."""
    store = dask_worker.plugins["kvstate"].runtime.store
    wrong = store.peek(h)[:, :, :, 1:].clone()
    store.device.d[h] = wrong
    return list(wrong.shape)


def _shape_here(dask_worker, h: bytes):
    t = dask_worker.plugins["kvstate"].runtime.store.peek(h)
    return None if t is None else list(t.shape)


def test_a_pulled_block_of_the_wrong_shape_is_recomputed_not_stored(fault_client):
    client = fault_client
    a, b = sorted(client.nthreads())
    text = "A wrong shape. " + CONTEXT
    with on(a):
        state = client.persist(kvs.materialize(text))
    ref = state.compute()
    bad = ref.blocks[2]
    wrong = client.run(_reshape_a_held_block, h=bad, workers=[a])[a]
    before = kvs.stats(client).workers[b]
    with on(b):
        outs = [client.compute(kvs.resume(state, q, max_new_tokens=12)).result() for q in (QUESTION, " And why?")]
    s = kvs.stats(client).workers[b]
    assert [o.token_ids for o in outs] == [replay(client, text, q).token_ids for q in (QUESTION, " And why?")]
    assert s.get("rejected_blocks", 0) - before.get("rejected_blocks", 0) == 1
    assert s["transfers"] - before.get("transfers", 0) == len(ref.blocks) - 1  # all but the bad one
    assert s["recomputes"] - before.get("recomputes", 0) == len(ref.blocks) - 2  # from the bad one on
    here = client.run(_shape_here, h=bad, workers=[b])[b]
    assert here is not None and here != wrong  # stored is the recomputed block, of the right shape


# -- the holder dies mid-workflow ------------------------------------------------------
def gate(name: str) -> str:
    """An empty prompt segment that arrives when the test sets the Event ``name``."""
    from distributed import Event, rejoin, secede

    secede()  # do not hold the worker's only thread while waiting
    Event(name).wait(timeout=120)
    rejoin()
    return ""


def test_holder_killed_mid_workflow_every_output_arrives_identical(fault_client):
    client = fault_client
    a, b = sorted(client.nthreads())
    text = "Killed mid-workflow. " + CONTEXT
    questions = [f" Question {i}: who is next?" for i in range(8)]
    want = [replay(client, text, q, n=16).token_ids for q in questions]
    before_b = kvs.stats(client).workers[b]
    # Loose: after the holder dies Dask may rebuild the state elsewhere from its lineage.
    with dask.annotate(workers=[a], allow_other_workers=True):
        state = kvs.materialize(text)
    branches = kvs.fork(state, len(questions))
    late = dask.delayed(gate, pure=False)("kvstate-test-gate")  # half the answers wait for it
    answers = client.compute(
        [
            kvs.resume(s, *([late] if i % 2 else []), q, max_new_tokens=16)
            for i, (s, q) in enumerate(zip(branches, questions))
        ]
    )
    client.sync(async_poll_for, lambda: all(f.status == "finished" for f in answers[::2]), timeout=120)
    assert not any(f.status == "finished" for f in answers[1::2])  # mid-workflow: these are still to come
    kill(client, a)
    from distributed import Event

    Event("kvstate-test-gate", client=client).set()
    wait(answers, timeout=120)
    got = [f.result().token_ids for f in answers]
    after_b = kvs.stats(client).workers[b]
    print(
        f"holder killed mid-workflow: {sum(g == w for g, w in zip(got, want))}/{len(want)} identical; survivor "
        f"re-materialized {after_b.get('materializations', 0) - before_b.get('materializations', 0)} states and "
        f"recomputed {after_b.get('recomputes', 0) - before_b.get('recomputes', 0)} blocks, transfer failures "
        f"+{after_b.get('transfer_failures', 0) - before_b.get('transfer_failures', 0)}"
    )
    assert got == want  # all 8 arrive, token-identical
    # The survivor rebuilt the dead holder's blocks (recompute from the text in the lineage).
    assert after_b.get("recomputes", 0) + after_b.get("materializations", 0) > (
        before_b.get("recomputes", 0) + before_b.get("materializations", 0)
    )
