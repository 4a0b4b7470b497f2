"""The bench command end to end on tiny-llama: result files written, baselines token-identical."""

from __future__ import annotations

import json

import pytest

from dask_kvstate.bench import cli
from dask_kvstate.bench.overhead import non_llm_graph

from .conftest import SPAWNED, vllm_test


def test_bench_scaling_and_memory_end_to_end(tmp_path):
    out = tmp_path / "bench"
    res = cli.main(
        [
            "scaling",
            "memory",
            "--quick",
            "--ks",
            "3",
            "--scaling-context",
            "128",
            "--new-tokens",
            "4",
            "--memory-context",
            "128",
            "--variants",
            "replay",
            "prefix",
            "kvstate",
            "--out",
            str(out),
        ]
    )
    for name in ("results.json", "report.md", "exp2_scaling.png", "exp4_memory.png"):
        assert (out / name).stat().st_size > 0, name
    row = res["scaling"][0]
    runs = {r["variant"]: r for r in row["runs"]}
    assert row["identical"] and runs["kvstate"]["token_ids"] == runs["replay"]["token_ids"]
    assert all(len(t) == 4 for t in runs["replay"]["token_ids"])
    # kvstate prefilled the shared context once, text replay once per agent.
    assert runs["kvstate"]["prefill_tokens"] < runs["replay"]["prefill_tokens"]
    assert runs["kvstate"]["resume_batches"] >= 1
    saved = json.loads((out / "results.json").read_text())
    assert saved["memory"][0]["branches"] == 3
    # Agents run side by side (two threads a worker): replay held more than one full cache at once.
    live = saved["memory_live"][0]
    assert live["branches"] == 3 and live["identical"] and live["threads"] == 2
    assert live["peak_replay_bytes"] >= 2 * live["context_tokens"] * saved["meta"]["kv_bytes_per_token"]
    assert live["peak_kvstate_bytes"] > 0
    assert "| k |" in (out / "report.md").read_text()


def test_bench_rejects_an_unknown_experiment():
    with pytest.raises(SystemExit):
        cli.parse(["nonsense"])


def test_non_llm_graph_has_the_asked_size():
    import dask

    g = non_llm_graph(1000, "t")
    assert 990 <= len(g.__dask_graph__()) <= 1000
    assert dask.compute(g, scheduler="sync")[0] == sum(range(1, 501))


def test_vllm_rows_table_reads_every_row_of_a_result():
    """The vLLM bench's table from a result of its shape: ratios against the best baseline,
    and the shared-cores row only where that run was made."""
    from dask_kvstate.bench.vllm_table import table

    agents = {
        "vllm_local_prefix_each_worker": {"wall_s": 20.0, "computed_prompt_tokens": 9000},
        "kvstate": {"wall_s": 16.0, "computed_prompt_tokens": 4500},
        "one_engine_both_cores": {"wall_s": 12.0, "computed_prompt_tokens": 5000},
    }
    res = {
        "length": 4096,
        "n_agents": 16,
        "new_tokens": 64,
        "branch_ttft": {"vllm_local_prefill_on_b": 10.0, "kvstate_pull_into_b": 0.5, "single_engine_hit": 0.4},
        "agents": agents,
        "arrivals": {
            "vllm_local_prefix_each_worker": {"mean_ttft_s": 3.0, "ttfts": [3.0] * 6},
            "kvstate": {"mean_ttft_s": 0.3, "ttfts": [0.3] * 6},
        },
    }
    text = table(res)
    assert "| 20.0x lower |" in text and "1.25x of the hit" in text
    assert "one engine on both cores (12.0 s) | 16.0 s | 0.75x |" in text
    assert "2.00x fewer" in text and "10.0x lower" in text
    assert "bound to both cores" not in text
    res["agents_shared_cores"] = {"local": {"wall_s": 18.0}, "kvstate": {"wall_s": 15.0}}
    assert "one engine on both cores 12.0 s | 15.0 s | 0.80x |" in table(res)
    assert "kvstate over transformers" not in table(res)
    agents["kvstate_over_transformers"] = {"wall_s": 10.0, "computed_prompt_tokens": 4500, "same_as_vllm": 15}
    assert "(12.0 s) | 10.0 s (4500 prompt tokens; 15 of 16 outputs equal to vLLM's) | 1.20x |" in table(res)


@vllm_test
def test_bench_puts_vllm_rows_beside_the_hf_rows(tmp_path, capfd):
    """Experiments 1 and 2 on both backends, same prompts: on vLLM, text replay computes
    every prompt token, the engines' own prefix caches no more, kvstate fewer, all three
    give the same tokens, and the vLLM replay is compared with transformers' agent by agent.
    Experiment 5's rows come from experiment 2's (its overhead columns, on no model, are
    ``test_overhead``'s: three more clusters here would add ~17 s and test nothing vLLM).

    The vLLM cluster's close logs no failed heartbeat: its workers' engines close off the
    event loop (vLLM's shutdown runs two full garbage collections), so a heartbeat in flight
    is answered before the scheduler goes (closed on the loop, every close logged one or two)."""
    import dask

    from dask_kvstate.bench import experiments as ex

    out = tmp_path / "bench"
    with dask.config.set({"kvstate.block-tokens": 64, **SPAWNED}):  # vLLM's CPU attention: a multiple of 32
        res = _both_backends(out)
    assert [r["backend"] for r in res["ttft"]] == [r["backend"] for r in res["scaling"]] == ["hf", "vllm"]
    assert {r["backend"] for row in res["scaling"] for r in ex.throughput([row])} == {"hf", "vllm"}
    for row in [*res["ttft"], *res["scaling"]]:
        assert row["identical"], row["backend"]
    runs = {r["variant"]: r for r in res["scaling"][1]["runs"]}
    assert runs["replay"]["prefill_tokens"] == sum(runs["replay"]["prompt_tokens"])
    # the engines' caches hit only for agents arriving after a first one's prefill; ours always reuse
    assert runs["kvstate"]["prefill_tokens"] <= runs["prefix"]["prefill_tokens"] <= runs["replay"]["prefill_tokens"]
    assert runs["kvstate"]["prefill_tokens"] < runs["replay"]["prefill_tokens"]
    assert res["meta"]["threads"] == {"hf": 1, "vllm": 2}
    assert {name: a["agents"] for name, a in res["backend_agreement"].items()} == {"ttft": 4, "scaling": 4}
    report = (out / "report.md").read_text()
    assert "| backend | k |" in report and "| vllm | 4 |" in report
    assert "Failed to communicate with scheduler during heartbeat" not in capfd.readouterr().err


def _both_backends(out):
    return cli.main(
        [
            "ttft",
            "scaling",
            "--model",
            "smollm2-135m",
            "--backends",
            "hf",
            "vllm",
            "--lengths",
            "192",
            "--agents",
            "4",
            "--ks",
            "4",
            "--scaling-context",
            "192",
            "--new-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
