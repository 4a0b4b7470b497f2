"""The agents-vs-raw report: rows in the order each round runs them, ratios against the
faster raw engine, outputs counted against the raw engine's, and its files.

The experiment itself starts a raw vLLM engine and two clusters (minutes): it runs from
the bench command and, at a small size, from asv (``asv_bench/benchmarks/raw_engine.py``).
These tests check what it reports from given rounds.
"""

from __future__ import annotations

import json

import pytest

from dask_kvstate.bench import agents_vs_raw


def _rounds(walls: list[float], outputs: list[list[int]]) -> list[dict]:
    return [{"wall_s": w, "outputs": outputs, "start_s": 1.0} for w in walls]


def test_rows_run_raw_engines_then_the_dask_path_then_kvstate():
    opts = agents_vs_raw.Options(backends=["vllm", "hf"], dask_path=["vllm"], raw=["raw-vllm-eager", "raw-vllm"])
    rows, _ = agents_vs_raw.runnable(opts)
    assert rows == ["raw-vllm-eager", "raw-vllm", "dask-path/vllm", "kvstate/vllm", "kvstate/hf"]


def test_rows_whose_backend_refuses_the_model_are_left_out_saying_why(tmp_path):
    from dask_kvstate.testing import architectures

    slides = str(architectures.build("mistral", tmp_path))  # every layer slides: kvstate's vLLM backend refuses it
    opts = agents_vs_raw.Options(model=slides, backends=["vllm", "hf"], dask_path=["vllm"], raw=["raw-vllm"])
    rows, why = agents_vs_raw.runnable(opts)
    assert rows == ["raw-vllm", "kvstate/hf"]  # raw vLLM runs what it serves
    assert list(why) == ["dask-path/vllm", "kvstate/vllm"]
    assert all("model type 'mistral' has 3 x sliding_attention" in w for w in why.values())
    text = agents_vs_raw.markdown({"options": {**vars(opts), "length": 64}, "table": {}, "left_out": why})
    assert "Left out, their backend refusing the model:" in text and "- kvstate/vllm: model type 'mistral'" in text
    assert agents_vs_raw.runnable(agents_vs_raw.Options())[1] == {}
    assert agents_vs_raw.runnable(agents_vs_raw.Options(model="gemma3-270m"))[1] == {}


def test_ratios_are_against_the_faster_raw_engine_and_outputs_against_its_first_round():
    want = [[1, 2, 3], [4, 5]]
    runs = {
        "raw-vllm": _rounds([40.0, 44.0, 42.0], want),
        "raw-vllm-eager": _rounds([37.0, 39.0, 38.0], want),
        "dask-path/vllm": _rounds([40.0, 39.0, 41.0], want),
        "kvstate/vllm": _rounds([30.0, 31.0, 29.0], [[1, 2, 3], [4, 6]]),  # one output differs each round
    }
    res = agents_vs_raw.report(runs, agents_vs_raw.Options(repeats=3))
    table = res["table"]
    assert table["raw-vllm-eager"]["wall_s"] == 38.0 and table["raw-vllm"]["wall_s"] == 42.0
    assert table["kvstate/vllm"]["speedup_vs_raw"] == pytest.approx(38.0 / 30.0)
    assert table["dask-path/vllm"]["speedup_vs_raw"] == pytest.approx(38.0 / 40.0)
    assert table["raw-vllm"]["speedup_vs_raw"] == pytest.approx(38.0 / 42.0)
    assert table["kvstate/vllm"]["identical"] == "3/6"
    assert table["dask-path/vllm"]["identical"] == "6/6"


def test_the_report_files_hold_every_row(tmp_path):
    runs = {"raw-vllm-eager": _rounds([10.0], [[7]]), "kvstate/hf": _rounds([8.0], [[7]])}
    res = agents_vs_raw.report(runs, agents_vs_raw.Options(repeats=1))
    res.update(context_tokens=100, cpu="test cpu")
    agents_vs_raw.write(res, tmp_path)
    assert json.loads((tmp_path / "agents_vs_raw.json").read_text())["table"]["kvstate/hf"]["identical"] == "1/1"
    md = (tmp_path / "agents_vs_raw.md").read_text()
    assert "| kvstate/hf | 8.00 s | 8.00 | 1.25x | 1/1 |" in md and "(test cpu)" in md
    assert (tmp_path / "agents_vs_raw.png").stat().st_size > 0


def test_a_rounds_phases_span_each_kind_of_task_in_the_task_stream():
    def task(key, *spans, action="compute"):
        return {"key": key, "startstops": [{"action": action, "start": a, "stop": b} for a, b in spans]}

    stream = [
        task("kvs-materialize-e58048a91abaf7128467179fabce933d", (10.0, 19.5)),
        task(("kvs-resume_many-c1522b8dba348c0c5c1c6d1485dfa9fb", 0), (19.5, 27.0)),
        task(("kvs-resume_many-c1522b8dba348c0c5c1c6d1485dfa9fb", 1), (20.0, 27.5)),
        task("kvs-generate-d818aed1bba55ef68284f496458f6642", (27.5, 27.5), (27.4, 27.5), action="transfer"),
    ]
    got = agents_vs_raw.phases(stream)
    assert got == pytest.approx({"kvs-materialize": 9.5, "kvs-resume_many": 8.0})  # transfers are not compute
    runs = {"kvstate/vllm": [{"wall_s": 18.0, "outputs": [[1]], "start_s": 1.0, "phases": got}]}
    res = agents_vs_raw.report(runs, agents_vs_raw.Options(repeats=1))
    assert "kvstate/vllm: kvs-materialize 9.50 s, kvs-resume_many 8.00 s" in agents_vs_raw.markdown(res)


def test_the_report_counts_each_rows_prompt_tokens_computed_as_the_median_of_its_rounds():
    runs = {
        "raw-vllm": [
            {"wall_s": w, "outputs": [[1]], "computed_tokens": c} for w, c in ((10.0, 6100), (11.0, 6000), (9.0, 6200))
        ],
        "kvstate/vllm": [{"wall_s": w, "outputs": [[1]], "computed_tokens": 4600} for w in (8.0, 7.0, 9.0)],
        "kvstate/hf": [{"wall_s": 9.0, "outputs": [[1]]}],  # a round without the count: none shown
    }
    res = agents_vs_raw.report(runs, agents_vs_raw.Options(repeats=3))
    assert res["table"]["raw-vllm"]["computed_tokens"] == 6100
    assert res["table"]["kvstate/vllm"]["computed_tokens"] == 4600
    assert "computed_tokens" not in res["table"]["kvstate/hf"]
    md = agents_vs_raw.markdown(res)
    assert "| prompt tokens computed |" in md
    assert "| raw-vllm | 10.00 s | 10.00, 11.00, 9.00 | 1.00x | 3/3 | 6,100 |" in md
    assert "| kvstate/vllm | 8.00 s | 8.00, 7.00, 9.00 | 1.25x | 3/3 | 4,600 |" in md
    assert "| kvstate/hf | 9.00 s | 9.00 | 1.11x | 1/1 | - |" in md


def test_a_kvstate_rows_engines_start_with_the_rows_kv_memory():
    # The client's kvstate config travels with the worker plugin and the engines start
    # under it: a row's engine memory set only around the cluster's start never reached
    # them (kvstate's engines ran with the 2 GiB default beside a raw engine of less).
    from distributed import get_client

    from dask_kvstate.protocol import WORKER_PLUGIN

    opts = agents_vs_raw.Options(model="tiny-llama", backends=["hf"], dask_path=[], raw=[], engine_kv="96MiB")
    with agents_vs_raw.started("kvstate/hf", opts):
        got = get_client().run(
            lambda dask_worker: dask_worker.plugins[WORKER_PLUGIN].config["kvstate"]["vllm"]["kv-cache-bytes"]
        )
    assert list(got.values()) == [96 * 2**20] * 2
