"""The KV-heavy Nalar workload: seeded requests, the table's ratios, and one short real run."""

from __future__ import annotations

import json

import pytest

from dask_kvstate.bench.nalar import kv_heavy
from dask_kvstate.bench.nalar.runner import summarize


def test_requests_are_seeded_and_bounded():
    opts = kv_heavy.Options(duration=20.0, rate=2.0, attempts=3)
    rs = kv_heavy.requests(opts, seed=1)
    assert rs == kv_heavy.requests(opts, seed=1)
    assert rs != kv_heavy.requests(opts, seed=2)
    assert all(0 <= r.arrival < 20.0 for r in rs)
    # every attempt count up to the cap occurs: the tester loop retries, and stops at the cap
    assert {len(lane) for r in rs for lane in r.lanes} == {1, 2, 3}
    for r in rs:
        for lane in r.lanes:
            assert lane[-1][0], "a lane ends with a passing test"
            assert not any(passed for passed, _ in lane[:-1])
    # no two requests share a context block: the ticket number leads the text
    assert kv_heavy.context(3, 2).startswith("Ticket 3. ")


def _row(config, latencies):
    keys = ("placed", "chose_pull", "chose_recompute", "blocks_pulled", "blocks_recomputed")
    kv = dict.fromkeys((*keys, "kv_moves", "dask_steals", "offloads", "imbalance"), 0)
    return {
        "workflow": "kv",
        "config": config,
        "offered": len(latencies),
        "unfinished": 0,
        **summarize(latencies),
        "token_identical": True,
        "checked": 1,
        "kv": kv,
    }


def test_table_ratios_against_the_best_baseline():
    rows = [_row("default", [2.0, 2.0]), _row("naive", [1.0, 1.0]), _row("kvstate", [0.5, 0.5])]
    text = kv_heavy.table(rows)
    assert "avg vs best baseline" in text and "P99 vs best baseline" in text
    kvstate = next(line for line in text.splitlines() if line.startswith("| kvstate "))
    assert "| 2.00x | -50% |" in kvstate  # against naive, the better baseline
    default = next(line for line in text.splitlines() if line.startswith("| default "))
    assert "| 0.50x | +100% |" in default


def test_unknown_config():
    with pytest.raises(ValueError, match="unknown config"):
        kv_heavy.run(kv_heavy.Options(configs="default,fancy"))


@pytest.mark.slow
def test_short_run(tmp_path):
    opts = kv_heavy.Options(
        duration=3.0, rate=1.0, workers=2, configs="naive,kvstate", context_repeats=6, checked=2, out=str(tmp_path)
    )
    rows = kv_heavy.run(opts)
    assert [r["config"] for r in rows] == ["naive", "kvstate"]
    for r in rows:
        assert r["workflow"] == "kv"
        assert r["unfinished"] == 0 and r["n"] == r["offered"] > 0
        assert r["token_identical"] and r["checked"] > 0
        assert r["p50"] <= r["p99"] <= r["max"]
        assert r["kv"]["placed"] > 0  # placement decided for the resumes in both
        assert r["kv"]["imbalance"] >= 1.0
    saved = json.loads((tmp_path / "kv.json").read_text())
    assert [r["config"] for r in saved["rows"]] == ["naive", "kvstate"]
    assert (tmp_path / "kv.md").read_text().startswith("| config |")
