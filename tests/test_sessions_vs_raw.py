"""Many multi-round sessions against the raw engine: the workload, the report, and a small
run end to end on SmolLM2 (a raw ``vllm.LLM`` fed as a server against kvstate's defaults,
every answer equal).

The end-to-end case skips, saying why, where vLLM is not installed (the ``vllm`` extra).
"""

from __future__ import annotations

import dataclasses
import json

import dask
import pytest

from dask_kvstate.bench import sessions_report
from dask_kvstate.bench import sessions_vs_raw as svr

from .conftest import SPAWNED, vllm_test


def _session(arrival: float, end: float, answers: list[list[int]]) -> dict:
    calls = [{"token_ids": a, "latency_s": 0.1, "computed_tokens": 100} for a in answers]
    return {"calls": calls, "arrival_s": arrival, "end_s": end}


def test_every_session_is_planner_developer_tester_round_after_round_on_its_own_ticket():
    calls = svr.prompts(2)
    assert [c.split(". ", 1)[1].split(":")[0] for c in calls] == ["Planner", "Developer", "Tester"] * 2
    assert all(c.endswith("<|im_start|>assistant\n") for c in calls)
    a, b = svr.ticket(0, 5), svr.ticket(1, 5)
    assert a[:30] != b[:30]  # the session number within the first block: no block is shared


def test_the_report_takes_the_better_raw_engine_per_figure_and_counts_answers_against_its_first_repeat():
    want = [[1, 2], [3]]
    runs = {
        # raw-vllm: the better mean, raw-vllm-eager the better P99
        "raw-vllm": [[_session(0, 10, want), _session(1, 21, want)]],  # e2e 10, 20
        "raw-vllm-eager": [[_session(0, 12, want), _session(1, 19, want)]],  # e2e 12, 18
        "kvstate": [[_session(0, 5, want), _session(1, 13, [[1, 2], [4]])]],  # e2e 5, 12; one answer differs
    }
    table = sessions_report.report(runs, svr.Options(repeats=1))["table"]
    assert table["raw-vllm"]["mean_s"] == 15.0 and table["raw-vllm-eager"]["mean_s"] == 15.0
    assert table["kvstate"]["mean_speedup"] == pytest.approx(15.0 / 8.5)
    best_p99 = table["raw-vllm-eager"]["p99_s"]
    assert best_p99 < table["raw-vllm"]["p99_s"]
    assert table["kvstate"]["p99_change"] == pytest.approx(table["kvstate"]["p99_s"] / best_p99 - 1)
    assert table["kvstate"]["identical"] == "3/4" and table["raw-vllm-eager"]["identical"] == "4/4"
    assert table["kvstate"]["computed_tokens"] == 400 and table["kvstate"]["makespan_s"] == 13


def test_raw_rows_run_again_with_more_engine_memory_and_the_best_raw_row_is_the_reference():
    # kvstate's store keeps evicted states in host memory beside its engine: the raw engine
    # given more KV memory is a baseline of its own, and the ratios take the best raw row.
    opts = svr.Options(variants=["raw-vllm-core-in-process", "kvstate"], raw_engine_kv=["2GiB", "3GiB"])
    assert svr.rows(opts) == {
        "raw-vllm-core-in-process": ("raw-vllm-core-in-process", "1GiB"),
        "raw-vllm-core-in-process (2GiB KV)": ("raw-vllm-core-in-process", "2GiB"),
        "raw-vllm-core-in-process (3GiB KV)": ("raw-vllm-core-in-process", "3GiB"),
        "kvstate": ("kvstate", "1GiB"),
    }
    assert svr.Options().raw_engine_kv == ["3GiB"] and svr.small().raw_engine_kv == []
    again = dataclasses.replace(opts, raw_engine_kv=["3GiB", "1GiB", "3GiB"])  # the same engine is run once
    assert list(svr.rows(again)) == ["raw-vllm-core-in-process", "raw-vllm-core-in-process (3GiB KV)", "kvstate"]
    want = [[1, 2]]
    runs = {
        "raw-vllm-core-in-process": [[_session(0, 40, want)]],  # thrashing at the same engine memory
        "raw-vllm-core-in-process (3GiB KV)": [[_session(0, 12, want)]],
        "kvstate": [[_session(0, 10, want)]],
    }
    table = sessions_report.report(runs, opts)["table"]
    assert table["kvstate"]["mean_speedup"] == pytest.approx(1.2)
    assert table["raw-vllm-core-in-process (3GiB KV)"]["identical"] == "1/1"
    md = sessions_report.markdown({"options": dataclasses.asdict(opts), "table": table})
    assert "engine KV 1GiB (raw rows also with 2GiB, 3GiB)" in md


def test_the_report_gives_each_row_its_engine_steps_and_the_seconds_in_them_as_medians():
    # An engine busy to the makespan is bounded by its own work: the table says how busy
    # each row's engine was, and in how many steps, beside its latencies.
    want = [[1]]
    runs = {"raw-vllm": [[_session(0, 10, want)]] * 3, "kvstate": [[_session(0, 8, want)]] * 3}
    steps = {
        "raw-vllm": [{"steps": 150, "step_s": 9.5}, {"steps": 148, "step_s": 9.9}, {"steps": 149, "step_s": 9.7}],
        "kvstate": [
            {"steps": 160, "step_s": 7.5, "load_s": 0.25, "capture_s": 0.25},
            {"steps": 170, "step_s": 7.0, "load_s": 0.5, "capture_s": 0.25},
            {"steps": 165, "step_s": 7.9, "load_s": 0.5, "capture_s": 0.5},
        ],
    }
    res = sessions_report.report(runs, svr.Options(repeats=3), steps)
    table = res["table"]
    assert (table["raw-vllm"]["engine_steps"], table["raw-vllm"]["engine_busy_s"]) == (149, 9.7)
    assert (table["kvstate"]["engine_steps"], table["kvstate"]["engine_busy_s"]) == (165, 7.5)
    assert (table["kvstate"]["engine_copy_s"], table["raw-vllm"]["engine_copy_s"]) == (0.75, 0.0)
    assert res["steps"] == steps
    md = sessions_report.markdown(res)
    assert "| engine steps | seconds in them | of which copying KV |" in md and "| 165 | 7.5 s | 0.8 s |" in md
    # A report without them (older runs' files) shows none.
    assert "| - | - | - |" in sessions_report.markdown(sessions_report.report(runs, svr.Options(repeats=3)))


def test_a_memory_size_that_does_not_parse_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"--raw-engine-kv 'lots' is not a memory size"):
        svr.command(svr.Options(raw_engine_kv=["lots"]))


def test_the_report_files_hold_every_row(tmp_path):
    runs = {"raw-vllm-eager": [[_session(0, 4, [[7]])]], "kvstate": [[_session(0, 2, [[7]])]]}
    res = sessions_report.report(runs, svr.Options(repeats=1))
    res["cpu"] = "test cpu"
    sessions_report.write(res, tmp_path)
    assert json.loads((tmp_path / "sessions_vs_raw.json").read_text())["table"]["kvstate"]["identical"] == "1/1"
    md = (tmp_path / "sessions_vs_raw.md").read_text()
    assert "| kvstate | 2.00 s | 2.00x |" in md and "(test cpu)" in md
    assert (tmp_path / "sessions_vs_raw.png").stat().st_size > 0


def test_every_experiment_runs_the_raw_engine_as_vllm_starts_it_and_with_its_core_in_process():
    """vLLM's default (its engine core in a process of its own) and the core in the engine's
    process (a setting a user can make, often the faster on few cores) are both baselines
    of every experiment unless told otherwise: the ratios are against the faster."""
    from dask_kvstate.bench import agents_vs_raw, beyond_memory
    from dask_kvstate.bench.raw_vllm import RAW

    assert RAW["raw-vllm-core-in-process"] == {"core_in_process": True}
    for defaults in (svr.Options().variants, beyond_memory.Options().variants, agents_vs_raw.Options().raw):
        assert "raw-vllm" in defaults and "raw-vllm-core-in-process" in defaults
    assert "raw-vllm-core-in-process" in svr.VARIANTS and "raw-vllm-core-in-process" in beyond_memory.VARIANTS


def test_an_unknown_variant_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"unknown variant\(s\) \['kvstate-fast'\]"):
        svr.command(svr.Options(variants=["kvstate-fast"]))


def test_a_model_kvstates_vllm_backend_refuses_is_refused_before_anything_starts(tmp_path):
    from dask_kvstate.backends.layout import UnsupportedModel
    from dask_kvstate.testing import architectures

    slides = str(architectures.build("mistral", tmp_path))  # every layer slides
    with pytest.raises(UnsupportedModel, match=r"sessions-vs-raw runs kvstate over vLLM: model type 'mistral' has"):
        svr.command(svr.Options(model=slides))


@vllm_test
def test_sessions_on_kvstate_answer_as_the_raw_engine_fed_as_a_server(tmp_path):
    # Three sessions of one round arriving together: the raw engine's step loop and
    # kvstate's defaults grow the same contexts, so every answer must be the same. (The
    # published runs' second raw row, more KV memory, is the same engine started with
    # another size: its row and report are checked above, without a third engine here.)
    opts = svr.small(
        sessions=3, rounds=1, new_tokens=4, threads=2, variants=["raw-vllm-eager", "kvstate"], out=str(tmp_path)
    )
    with dask.config.set({"kvstate.block-tokens": 64, **SPAWNED}):
        res = svr.command(opts)
    table = res["table"]
    assert table["kvstate"]["identical"] == "9/9" and table["raw-vllm-eager"]["identical"] == "9/9"
    raw = res["runs"]["raw-vllm-eager"][0]
    # The raw engine's prefix cache served each session's later calls from its earlier ones.
    assert all(s["calls"][-1]["cached_tokens"] > 0 for s in raw)
    assert all(len(s["calls"]) == 3 and s["end_s"] >= s["arrival_s"] for s in res["runs"]["kvstate"][0])
    # Both engines counted their steps over the measured run, and the seconds in them
    # fit inside it (kvstate's from its worker's engine through kvs.stats).
    for row in table.values():
        assert row["engine_steps"] >= 4 and 0 < row["engine_busy_s"] <= row["makespan_s"] + 1.0
        assert 0 <= row["engine_copy_s"] < row["engine_busy_s"]
    assert (tmp_path / "sessions_vs_raw.md").exists()
