"""Workflow-aware scheduling (Nalar): latency against the best baseline, control loop latency.

Every side of each ratio runs in the same benchmark process, replaying the same seeded
arrivals and durations (:mod:`dask_kvstate.bench.nalar`). The baselines are stock Dask
as a user would configure it: ``default`` (the even role split), ``naive`` (a
hand-written ``priority=`` by request progress) and ``static-best`` (the best of a
small grid of static role splits, chosen in hindsight). ``track_avg_vs_best_baseline``
is the lowest baseline average end-to-end latency over ours (above 1: ours is faster),
``track_p99_cut_vs_best_baseline`` the share of the lowest baseline P99 we remove.
``track_control_loop_*`` is the global control loop's pass latency with 10,000 futures queued.
The scale from 10^3 to 10^5 futures over 10^3 sessions on 100 workers (``--control-loop-scale``,
``docs/nalar/control_loop_scale.md``) stays out of asv: its 10^5 point alone takes minutes.
"""

from __future__ import annotations

import asyncio

from dask_kvstate.bench import nalar

#: Seconds of seeded arrivals per workflow and run: 35 requests of swe and analyst, 100
#: of router (``python -m dask_kvstate.bench nalar-workflows`` runs 40 s and a grid of 10 for its tables).
ARRIVAL_SECONDS = 5.0
#: Role-free SWE arrives at 3.2 requests/s and loads its threads only after a few seconds.
ROLE_FREE_SECONDS = 12.0
#: Static splits the ``static-best`` grid runs per workflow.
GRID_MAX = 3


class WorkflowLatency:
    """Per workflow, ``all`` (every policy on) against the best of the baselines.

    ``phases`` needs two 10 s phases to mean anything: it stays in
    ``python -m dask_kvstate.bench nalar-workflows``, keeping this suite near two minutes. ``swe-free``
    has no split to search: :class:`RoleFreeLatency`.
    """

    params = (["swe", "router", "analyst"],)
    param_names = ["workflow"]
    timeout = 900
    number = 1
    repeat = 1

    def setup_cache(self):
        out = {}
        for name in self.params[0]:
            wf = nalar.configure(name)
            rows = {
                c: asyncio.run(nalar.run_one(wf, c, duration=ARRIVAL_SECONDS, seed=0, drain=60.0))
                for c in ("default", "naive", "all")
            }
            grid = nalar.grid_search(
                wf, seeds=[0], duration=ARRIVAL_SECONDS, grid_duration=ARRIVAL_SECONDS, drain=60.0, grid_max=GRID_MAX
            )
            rows["static-best"] = grid["best"]["runs"][0]
            out[name] = rows
        return out

    def track_avg_vs_best_baseline(self, rows, workflow):
        best_avg, _ = nalar.best_baselines(list(rows[workflow].values()))
        return best_avg["avg"] / rows[workflow]["all"]["avg"]

    track_avg_vs_best_baseline.unit = "x"

    def track_p99_cut_vs_best_baseline(self, rows, workflow):
        _, best_p99 = nalar.best_baselines(list(rows[workflow].values()))
        return 100 * (1 - rows[workflow]["all"]["p99"] / best_p99["p99"])

    track_p99_cut_vs_best_baseline.unit = "%"


class RoleFreeLatency:
    """Role-free SWE (4 generic workers): ``kvstate`` (``kvs.install`` defaults) against
    stock Dask and ``naive``; the gain is late binding's global queue, input-aware
    placement and continuation slot under progress priority."""

    timeout = 600
    number = 1
    repeat = 1

    def setup_cache(self):
        wf = nalar.configure("swe-free")
        return {
            c: asyncio.run(nalar.run_one(wf, c, duration=ROLE_FREE_SECONDS, seed=0, drain=60.0))
            for c in ("default", "naive", "kvstate")
        }

    def track_avg_vs_best_baseline(self, rows):
        best_avg, _ = nalar.best_baselines(list(rows.values()))
        return best_avg["avg"] / rows["kvstate"]["avg"]

    track_avg_vs_best_baseline.unit = "x"

    def track_avg_vs_stock_dask(self, rows):
        return rows["default"]["avg"] / rows["kvstate"]["avg"]

    track_avg_vs_stock_dask.unit = "x"

    def track_p99_cut_vs_stock_dask(self, rows):
        return 100 * (1 - rows["kvstate"]["p99"] / rows["default"]["p99"])

    track_p99_cut_vs_stock_dask.unit = "%"


class ControlLoop:
    """Per phase of :func:`nalar.control_loop` (futures queued behind busy role workers,
    then on the scheduler itself), each on its own cluster, both measured in ``setup_cache``."""

    params = (["role-restricted, queued on workers", "root-ish, queued on the scheduler"],)
    param_names = ["phase"]
    timeout = 300
    number = 1
    repeat = 1

    def setup_cache(self):
        return asyncio.run(nalar.control_loop(10_000, seconds=5.0))

    def track_control_loop_p99_ms(self, res, phase):
        return res[phase]["loop"]["total"]["p99_ms"]

    track_control_loop_p99_ms.unit = "ms"

    def track_control_loop_max_ms(self, res, phase):
        return res[phase]["loop"]["total"]["max_ms"]

    track_control_loop_max_ms.unit = "ms"
