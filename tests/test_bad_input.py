"""Bad input from users: wrong states offered for reuse are never reused (and counted),
invalid calls fail with errors that name the argument and the fix."""

from __future__ import annotations

from dataclasses import replace

import dask
import pytest

import dask_kvstate as kvs

from .conftest import CONTEXT, on, stats_of


def replay(client, *segments, n=8):
    return client.compute(kvs.generate(*segments, max_new_tokens=n)).result()


def incompatible(client) -> int:
    return sum(s.get("incompatible", 0) for s in kvs.stats(client).workers.values())


def test_wrong_positions_are_never_reused(client, workers):
    a, _ = workers
    with on(a):
        ref = client.compute(kvs.materialize("Positions. " + CONTEXT)).result()
    other = CONTEXT.replace("planner", "auditor")
    forged = {
        other: replace(ref, text=other),  # the block table of one text, offered for another text
        ref.text: replace(ref, blocks=ref.blocks[::-1]),  # the right blocks at the wrong positions
    }
    for text, bad in forged.items():
        before = incompatible(client)
        with on(a):
            out = client.compute(kvs.resume(bad, " Who?", max_new_tokens=8)).result()
        assert incompatible(client) == before + 1  # stated in stats
        assert out.reused_tokens == 0  # recomputed, never reused
        assert out.token_ids == replay(client, text, " Who?").token_ids


def test_invalid_calls_name_the_argument_and_the_fix(client):
    state = kvs.materialize("Invalid calls. " + CONTEXT)
    for k in (0, -2, True, "3", 2.0):
        with pytest.raises(ValueError, match=r"positive int k.*number of branches.*use k >= 1"):
            kvs.fork(state, k)
    with pytest.raises(ValueError, match="unknown merge policy 'blend'; supported: 'concat'"):
        kvs.merge(state, state, policy="blend")
    with pytest.raises(ValueError, match="merge needs at least one state"):
        kvs.merge()
    with pytest.raises(ValueError, match="transfer needs a worker address"):
        kvs.transfer(state, "")
    with pytest.raises(ValueError, match=r"unknown model 'gpt-17'; known: .*tiny-llama.*local model folder"):
        kvs.install(client, "gpt-17")
    with pytest.raises(ValueError, match=r"kvstate.worker.disk-bytes must be a byte size like '16GiB', got 'lots'"):
        with dask.config.set({"kvstate.worker.disk-bytes": "lots"}):
            kvs.install(client, "tiny-llama")
    with pytest.raises(ValueError, match=r"unknown config key kvstate.placment"):
        with dask.config.set({"kvstate.placment.rule": "pull"}):
            kvs.install(client, "tiny-llama")
    # Incompatible merges: which states, why, and what to do instead.
    other_tenant = kvs.extend(kvs.materialize("Invalid calls. " + CONTEXT, namespace="tenant-x"), " More.")
    with pytest.raises(
        kvs.MergeError,
        match=r"namespace differs.*Merge only states of one model, config and "
        r"namespace.*kvs.extend",
    ):
        dask.compute(kvs.merge(state, other_tenant))
    left, right = kvs.extend(state, " Left."), kvs.extend(state, " Right.")
    with pytest.raises(kvs.MergeError, match=r"diverge at character \d+.*each state must continue the previous one"):
        dask.compute(kvs.merge(left, right))
    with pytest.raises(TypeError, match=r"state must be a KVStateRef \(the result of kvs.materialize"):
        client.compute(kvs.resume("a string, not a state", " Q?")).result()


def test_resume_on_an_evicted_state_is_not_an_error_it_recomputes(client, workers):
    a, _ = workers
    text = "Evicted, then resumed. " + CONTEXT
    with on(a):
        state = kvs.materialize(text).persist()
    ref = state.compute()
    assert kvs.evict(state).compute() == ref.nbytes
    before = stats_of(client, a)
    with on(a):
        out = client.compute(kvs.resume(state, " Who?", max_new_tokens=8)).result()
    after = stats_of(client, a)
    assert out.token_ids == replay(client, text, " Who?").token_ids
    assert after["recomputes"] - before.get("recomputes", 0) == len(ref.blocks)  # rebuilt from its text
