"""What the plugins and the compiler do to graphs with no LLM call in them.

Nothing, and cheaply: the compiler hands back Dask's own optimised graph and reads it in
one pass; the plugins keep no per-task state and log no event for such tasks.
"""

from __future__ import annotations

import dask
from dask.delayed import optimize as delayed_optimize
from dask.highlevelgraph import HighLevelGraph

import dask_kvstate as kvs
from dask_kvstate import graph_opt
from dask_kvstate.bench.overhead import non_llm_graph


def test_compiler_returns_dasks_own_graph_when_there_is_no_llm_call(monkeypatch):
    g = non_llm_graph(400, "no-llm")
    seen = []

    def dask_pass(dsk, keys, **kwargs):  # Dask's pass, recording what it returned
        seen.append(delayed_optimize(dsk, keys, **kwargs))
        return seen[-1]

    monkeypatch.setattr(graph_opt, "_delayed_optimize", dask_pass)
    out = graph_opt.optimize(g.__dask_graph__(), g.__dask_keys__())
    assert out is seen[0], "a graph with nothing to share must come back as Dask's pass left it"
    assert graph_opt.recent_plans()[-1]["calls"] == 0


def test_compiler_reads_a_many_layer_graph_in_one_pass(monkeypatch):
    # A delayed graph has one layer per task; dict(hlg) looks every key up across all the
    # layers (quadratic: 15 s of scheduler CPU at 10,000 tasks). Count those lookups.
    g = non_llm_graph(400, "one-pass")
    assert len(g.__dask_graph__().layers) > 300
    lookups = []
    original = HighLevelGraph.__getitem__

    def counting(self, key):
        lookups.append(key)
        return original(self, key)

    monkeypatch.setattr(HighLevelGraph, "__getitem__", counting)
    out = graph_opt.optimize(g.__dask_graph__(), g.__dask_keys__())
    assert lookups == [], f"the pass looked up {len(lookups)} keys through HighLevelGraph.__getitem__"
    assert dask.compute(g, scheduler="sync", optimize_graph=False)[0] == sum(range(1, 201))
    assert dask.get(out.to_dict(), g.key) == sum(range(1, 201))


def test_compiler_still_rewrites_llm_calls_in_a_many_layer_graph():
    # The rewrite copies the graph before changing it: to_dict() is cached on the graph.
    prefix = "You are one of several agents reviewing the same long shared context. " * 2
    outs = [kvs.generate(prefix, f"Agent {i}: answer.", max_new_tokens=2) for i in range(3)]
    extra = non_llm_graph(50, "mixed")
    graph = HighLevelGraph.merge(*(d.__dask_graph__() for d in [*outs, extra]))
    keys = [d.key for d in outs] + [extra.key]
    before = dict(graph.to_dict())
    out = graph_opt.optimize(graph, keys)
    assert any(str(k).startswith("kvs-materialize-") for k in out.to_dict())
    assert graph.to_dict() == before, "the input graph must not change"


def test_overhead_experiment_measures_every_column_on_idle_clusters(tmp_path):
    # Small graph, one measured round: what matters here is that every column runs on a
    # cluster the last run left empty, and that CPU per task and load reach the report.
    from dask_kvstate.bench import cli

    out = tmp_path / "overhead"
    res = cli.main(["overhead", "--quick", "--overhead-tasks", "200", "--overhead-repeats", "1", "--out", str(out)])
    o = res["overhead"]
    assert set(o["times_s"]) == {"plain", "plugins", "plugins+compiler"}
    assert all(len(v) == 1 for v in o["times_s"].values())
    for column in o["cpu_s"].values():
        assert column["scheduler"][0] > 0 and column["workers"][0] > 0
    assert len(o["load_average"]["start"]) == 3
    assert "workers CPU us/task" in (out / "report.md").read_text()
