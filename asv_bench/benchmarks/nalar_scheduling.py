"""Workflow-aware scheduling (Nalar): latency against stock Dask, control loop latency.

Both sides of each ratio run in the same benchmark process, replaying the same seeded
arrivals and durations (:mod:`dask_kvstate.bench.nalar`): ``track_avg_speedup`` is
stock Dask's average end-to-end latency over ours (above 1: ours is faster),
``track_p99_cut`` the share of stock Dask's P99 we remove. ``track_control_loop_*``
is the global control loop's pass latency with 10,000 futures queued. The scale from 10^3
to 10^5 futures over 10^3 sessions on 100 workers (``--control-loop-scale``,
``docs/nalar/control_loop_scale.md``) stays out of asv: its 10^5 point alone takes minutes.
"""

from __future__ import annotations

import asyncio

from dask_kvstate.bench import nalar

#: Seconds of seeded arrivals per workflow and configuration: 70 requests of swe and
#: analyst, 200 of router (``examples/nalar_workflows.py`` runs 40 s for its tables).
ARRIVAL_SECONDS = 10.0


class WorkflowLatency:
    params = (["swe", "router", "analyst"],)
    param_names = ["workflow"]
    timeout = 600
    number = 1
    repeat = 1

    def setup_cache(self):
        out = {}
        for name in self.params[0]:
            wf = nalar.WORKFLOWS[name]
            rows = {
                c: asyncio.run(nalar.run_one(wf, c, duration=ARRIVAL_SECONDS, seed=0, drain=60.0))
                for c in ("default", "all")
            }
            out[name] = rows
        return out

    def track_avg_speedup(self, rows, workflow):
        r = rows[workflow]
        return r["default"]["avg"] / r["all"]["avg"]

    track_avg_speedup.unit = "x"

    def track_p99_cut(self, rows, workflow):
        r = rows[workflow]
        return 100 * (1 - r["all"]["p99"] / r["default"]["p99"])

    track_p99_cut.unit = "%"


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
