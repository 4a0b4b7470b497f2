"""The stateful compiler on real delayed graphs: every shape token-identical with it off and on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dask
import pytest
from distributed import Client

import dask_kvstate as kvs
from dask_kvstate.graph_opt import RECENT_PLANS, recent_plans
from dask_kvstate.testing import shapes

from .conftest import TEST_CONFIG, compute_released


def prefill_tokens(client) -> int:
    return sum(s.get("prefill_tokens", 0) for s in kvs.stats(client).workers.values())


def run(client, outs, compiler: bool):
    before = prefill_tokens(client)
    t0 = time.perf_counter()
    if compiler:
        with kvs.stateflow():
            res = dask.compute(*outs)
    else:
        res = dask.compute(*outs)
    return res, prefill_tokens(client) - before, time.perf_counter() - t0


@pytest.mark.parametrize("shape", sorted(shapes.SHAPES))
def test_shape_is_token_identical_with_the_compiler_and_prefills_less(client, shape):
    outs = shapes.SHAPES[shape]()
    plan = kvs.explain(*outs)
    assert plan.plan.states, f"the compiler found nothing to share in {shape}"
    off, prefill_off, _ = run(client, outs, compiler=False)
    on, prefill_on, _ = run(client, shapes.SHAPES[shape](), compiler=True)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert sum(o.reused_tokens for o in on) > 0 and all(o.reused_tokens == 0 for o in off)
    assert prefill_on < prefill_off


def test_debate_rounds_become_extends_of_the_previous_state():
    plan = kvs.explain(*shapes.debate(rounds=3, agents=2)).plan
    ops = [st.op for st in plan.states.values()]
    assert ops[0] == "materialize" and ops.count("extend") >= 3
    # Every extend hangs off another state: one chain of growing transcripts.
    assert all(st.parent in plan.states for st in plan.states.values() if st.op == "extend")
    assert len(plan.resumes) == 6


def test_nested_prefixes_share_at_every_level():
    plan = kvs.explain(*shapes.nested()).plan
    roots = [st for st in plan.states.values() if st.op == "materialize"]
    assert len(roots) == 1 and len(roots[0].children) == 2  # system -> two documents


def test_rag_document_from_an_upstream_task_is_shared():
    outs = shapes.rag()
    plan = kvs.explain(*outs).plan
    (st,) = plan.states.values()
    assert st.has_key_segment and any(s.kind == "key" for s in st.segments)
    dot = kvs.explain(*outs).to_dot()
    assert "style=dashed" in dot and dot.count("->") >= 4


def test_nothing_shared_leaves_the_graph_unchanged():
    outs = shapes.unshared()
    from dask.delayed import optimize as delayed_optimize
    from dask.highlevelgraph import HighLevelGraph

    hlg = HighLevelGraph.merge(*[o.dask for o in outs])
    keys = [o.key for o in outs]
    plain = delayed_optimize(hlg, keys)
    compiled = kvs.optimize(hlg, keys)
    assert dict(compiled).keys() == dict(plain).keys()
    assert all(dict(compiled)[k] is dict(plain)[k] for k in keys)


def test_output_keys_survive_and_annotations_too(client):
    a, b = client.nthreads()
    with dask.annotate(workers=[b], allow_other_workers=False):
        outs = shapes.tree_of_thought(k=2, n=4)
    with kvs.stateflow():
        futures = client.compute(outs)
        res = client.gather(futures)
    assert [f.key for f in futures] == [o.key for o in outs]
    assert all(r.reused_tokens > 0 for r in res)
    assert set().union(*client.who_has(futures).values()) == {b}  # the user's restriction held


def test_min_shared_chars_turns_short_prefixes_off():
    outs = [kvs.generate("Hi. ", f"Question {i}", max_new_tokens=2) for i in range(3)]
    assert kvs.explain(*outs).plan.empty
    assert not kvs.explain(*outs, min_shared_chars=0).plan.empty


def test_a_bad_task_fails_the_pass_with_its_name(client):
    bad = kvs.generate("A long enough shared prefix for the compiler. ", 42, max_new_tokens=2)
    with pytest.raises(kvs.StateflowError, match=f"task '{bad.key}' has prompt segment 1 of type int"):
        kvs.explain(bad)
    with kvs.stateflow(), pytest.raises(Exception, match=bad.key):
        client.compute(bad).result()


def test_two_models_in_one_graph_never_share(other_model):
    from distributed import LocalCluster

    outs = [
        kvs.generate(shapes.SYSTEM, shapes.REPORT, f"Q{i}", max_new_tokens=6, model=m)
        for m in (None, other_model)
        for i in range(2)
    ]
    plan = kvs.explain(*outs).plan
    assert sorted(str(st.model) for st in plan.states.values()) == sorted([str(None), other_model])
    with dask.config.set(TEST_CONFIG):
        with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as c:
            kvs.install(c, ["tiny-llama", other_model], torch_threads=1)
            off = compute_released(*outs)
            with kvs.stateflow():
                on = dask.compute(*outs)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert off[0].token_ids != off[2].token_ids  # really two different models


def test_the_pass_runs_in_a_separate_dask_scheduler_process(tmp_path):
    dask_cli = shutil.which("dask", path=str(Path(sys.executable).parent))
    env = {**os.environ, "DASK_KVSTATE__BLOCK_TOKENS": "16"}
    sched_file = tmp_path / "scheduler.json"
    procs = [
        subprocess.Popen(
            [dask_cli, "scheduler", "--port", "0", "--no-dashboard", "--scheduler-file", str(sched_file)],
            env=env,
            cwd=tmp_path,
        )
    ]
    try:  # both the worker and the Client wait for the scheduler file to appear
        procs.append(
            subprocess.Popen(
                [dask_cli, "worker", "--scheduler-file", str(sched_file), "--nthreads", "1", "--no-dashboard"],
                env=env,
                cwd=tmp_path,
            )
        )
        with Client(scheduler_file=str(sched_file), timeout=60) as c:
            c.wait_for_workers(1, timeout=60)
            kvs.install(c, "tiny-llama", torch_threads=1)
            local_before = len(RECENT_PLANS)
            outs = shapes.tree_of_thought(k=3, n=6)
            off = compute_released(*outs)
            with kvs.stateflow():
                on = dask.compute(*shapes.tree_of_thought(k=3, n=6))
            remote = c.run_on_scheduler(recent_plans)
            scheduler_has_torch = c.run_on_scheduler(lambda: "torch" in sys.modules)
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        assert any(p["states"] == 1 and p["resumes"] == 3 for p in remote)
        assert len(RECENT_PLANS) == local_before  # it ran over there, not here
        assert not scheduler_has_torch  # and loaded no model there
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=30)


def test_inserted_states_inherit_the_annotations_their_calls_agree_on():
    from dask.highlevelgraph import HighLevelGraph

    with dask.annotate(resources={"GPU": 1}, retries=3):
        outs = shapes.tree_of_thought(k=3, n=4)
    hlg = HighLevelGraph.merge(*[o.dask for o in outs])
    compiled = kvs.optimize(hlg, [o.key for o in outs])
    (layer,) = compiled.layers.values()
    (state_key,) = kvs.explain(*outs).plan.states
    assert layer.annotations["resources"](state_key) == {"GPU": 1}
    assert layer.annotations["retries"](state_key) == 3
    assert layer.annotations["kvstate"](state_key)["op"] == "materialize"
    assert layer.annotations["kvstate"](outs[0].key) is None  # calls are data-edge consumers
