"""The Nalar scheduling harness: its baselines, grid candidates, workloads and report (no timing asserted)."""

from __future__ import annotations

import asyncio

import numpy as np
from distributed import Client, LocalCluster
from distributed.utils_test import poll_for

from dask_kvstate.bench import nalar
from dask_kvstate.bench.nalar import report
from dask_kvstate.bench.nalar.baselines import grid_candidates, offered_load, splits
from dask_kvstate.bench.nalar.components import work
from dask_kvstate.bench.nalar.runner import cluster_spec
from dask_kvstate.bench.nalar.workflows import Draws, Request, arrival_times, heavy_role, kind_of, spread, with_split
from dask_kvstate.plugins.scheduler.queueing import expected_queue


def test_grid_keeps_the_stable_splits_fewest_calls_expected_to_wait_first():
    load = {"planner": 0.4, "developer": 4.6, "tester": 2.4}
    got = grid_candidates(load, 12, 10)
    # every kept split gives each role more units than its offered work, best first
    assert all(all(load[r] < n for r, n in s.items()) for s, _ in got)
    queues = [expected_queue(load, s) for s, _ in got]
    assert queues == sorted(queues)
    assert got[0][0] == {"planner": 1, "developer": 7, "tester": 4}
    assert len(got) == 10
    assert len(grid_candidates(load, 12, 3)) == 3


def test_grid_falls_back_to_every_split_by_max_utilisation_when_none_is_stable():
    load = {"developer": 5.0, "tester": 5.0}  # 10 units of work on 8
    got = grid_candidates(load, 8, 10)
    assert [s for s, _ in got][:1] == [{"developer": 4, "tester": 4}]
    assert len(got) == len(list(splits(["developer", "tester"], 8))) == 7
    assert got[0][1] == 1.25


def test_splits_cover_every_composition_with_a_unit_each():
    all_ = list(splits(["a", "b", "c"], 12))
    assert len(all_) == 55  # C(11, 2)
    assert all(sum(s.values()) == 12 and min(s.values()) >= 1 for s in all_)


def test_phases_draws_are_deterministic_and_the_heavy_role_flips():
    wf = nalar.configure("phases")
    kind = kind_of(wf)
    a, b = arrival_times(wf, 40.0, 0), arrival_times(wf, 40.0, 0)
    assert np.array_equal(a, b)
    plans = [kind.plan(Draws(wf, 0, rid), float(t), 40.0) for rid, t in enumerate(a)]
    assert plans == [kind.plan(Draws(wf, 0, rid), float(t), 40.0) for rid, t in enumerate(a)]
    for phase, heavy in enumerate(["developer", "tester", "developer", "tester"]):
        inside = [p for p, t in zip(plans, a) if phase * 10 <= t < (phase + 1) * 10]
        dev, test = np.mean([p[0] for p in inside]), np.mean([p[1] for p in inside])
        assert heavy_role(wf, phase * 10 + 5.0) == heavy
        assert (dev > 4 * test) if heavy == "developer" else (test > 4 * dev)
    # the burst: the first 2 s of a phase see twice the rate
    in_burst = np.sum(a % 10 < 2) / 2
    outside = np.sum(a % 10 >= 2) / 8
    assert 1.5 < in_burst / outside < 2.5  # twice the rate, give or take the draw
    load = offered_load(wf, 40.0, [0])
    assert 0.6 * 8 < sum(load.values()) < 0.9 * 8


def test_phases_layout_is_two_workers_of_four_threads_and_a_split_spreads_over_them():
    spec = cluster_spec(nalar.configure("phases"))
    assert [w["options"]["nthreads"] for w in spec.values()] == [4, 4]
    assert all(w["options"]["resources"] == {"role:developer": 2, "role:tester": 2} for w in spec.values())
    split = with_split(nalar.configure("phases"), {"developer": 7, "tester": 1})
    assert (
        split.workers
        == spread({"developer": 7, "tester": 1}, 2)
        == [
            {"developer": 4, "tester": 0},
            {"developer": 3, "tester": 1},
        ]
    )
    assert [w["options"]["resources"] for w in cluster_spec(split).values()] == [
        {"role:developer": 4},
        {"role:developer": 3, "role:tester": 1},
    ]
    free = cluster_spec(nalar.configure("swe-free"))
    assert len(free) == 4 and all(w["options"] == {"nthreads": 1, "resources": {}} for w in free.values())


def test_configure_copies_the_workflow():
    nalar.configure("swe", rate=1.0, roles="planner=1,developer=7,tester=4")
    assert nalar.WORKFLOWS["swe"].rate == 7.0 and nalar.WORKFLOWS["swe"].roles["planner"] == 4


def _priority(key, dask_scheduler=None):
    ts = dask_scheduler.tasks.get(key)
    return ts.priority if ts is not None else None


def _priority_of(c: Client, key: str) -> tuple:
    """The key's priority on the scheduler, once its graph arrived there (submit does not wait)."""
    poll_for(lambda: c.run_on_scheduler(_priority, key) is not None, timeout=10, period=0.01)
    return c.run_on_scheduler(_priority, key)


def test_naive_priority_is_the_requests_completed_calls_and_reaches_the_scheduler():
    wf = nalar.configure("phases")
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=False,
            dashboard_address=":0",
            resources={"role:developer": 1, "role:tester": 1},
        ) as cluster,
        Client(cluster) as c,
    ):
        r = Request(c, wf, 0, naive=True)
        first = r.submit(work, 0.0, key="developer-0", role="developer")
        first.result()
        # done callbacks run on a thread of their own
        poll_for(lambda: r.completed >= 1, timeout=10, period=0.01)
        second = r.submit(work, 1.0, first, key="tester-0", role="tester")
        # user priority is negated into the first element of Dask's priority tuple
        assert _priority_of(c, "developer-0")[0] == 0
        assert _priority_of(c, "tester-0")[0] == -1
        plain = Request(c, wf, 1)  # not naive: no priority, whatever its progress
        plain.completed = 5
        third = plain.submit(work, 0.0, key="developer-1", role="developer")
        assert _priority_of(c, "developer-1")[0] == 0
        third.result()
        second.cancel()


def test_report_compares_each_row_with_the_best_baseline():
    row = {"workflow": "w", "offered": 10, "n": 10, "unfinished": 0, "p50": 1.0, "p95": 1.0, "max": 1.0}
    rows = [
        {**row, "config": "default", "avg": 2.0, "p99": 4.0},
        {**row, "config": "naive", "avg": 1.0, "p99": 5.0},
        {**row, "config": "static-best", "avg": 1.5, "p99": 3.0},
        {**row, "config": "all", "avg": 0.5, "p99": 1.5},
    ]
    best_avg, best_p99 = nalar.best_baselines(rows)
    assert (best_avg["config"], best_p99["config"]) == ("naive", "static-best")
    line = report.table(rows).splitlines()[-1]
    assert line.endswith("| 4.00x | -62% | 2.00x | -50% |")
    assert report.best_line(rows).startswith("best baseline: naive")


def _smoke(name: str, config: str) -> dict:
    return asyncio.run(nalar.run_one(nalar.configure(name), config, duration=3.0, seed=0, drain=30.0))


def test_phases_and_swe_free_run_under_stock_dask():
    for name in ("phases", "swe-free"):
        r = _smoke(name, "default")
        assert r["workflow"] == name and r["config"] == "default"
        assert r["unfinished"] == 0 and r["n"] == r["offered"] > 0
        assert {"avg", "p50", "p95", "p99", "max", "steals", "roles"} <= set(r)
        assert r["avg"] > 0
