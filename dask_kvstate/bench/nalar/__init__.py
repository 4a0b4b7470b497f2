"""Nalar's agent workflows on Dask, with and without workflow-aware scheduling.

Each workflow is ordinary Python over futures: one coroutine per request, inside
``kvs.session``, submitting components as tasks that ask for their agent role
(``resources={"role:developer": 1}``). Components sleep for durations drawn from seeded
heavy-tailed (log-normal) profiles, so a run needs no CPU and one process holds many
workers: by default single-thread, one unit of one role each; a workflow may lay out
multi-unit workers instead (a thread per unit). Requests arrive open-loop (Poisson,
seeded), and every configuration replays the very same arrivals, durations and test
outcomes, so the rows of the table differ only in scheduling. A log-normal of median
``m`` and sigma ``s`` has mean ``m * exp(s**2 / 2)``.

* ``swe``: planner -> 3 developers -> a tester each; a failed test goes back to the
  same developer lane (up to 4 attempts). A developer attempt that lands on another
  worker than the lane's previous one pays a context rebuild (half a median call: its
  KV is elsewhere). The previous attempt's result is its input, and that result's
  ``dask.sizeof`` is the KV bytes a move would carry (as for ``KVStateRef``), so Dask
  and the policies see the price of moving through the usual transfer estimate. With
  ``stateful`` the developer gets Nalar's ``stateful`` hint, and its retries keep
  session affinity (never migrated).
* ``analyst``: financial analyst, fan-out to 4 analysts, a summary, and half of the
  requests come back after a think time with a follow-up (2 analysts, a summary).
* ``router``: a classifier routes to ``chat`` or ``code``; the share of code grows
  from 50% to 95% over the first 40% of the arrivals and stays there.
* ``phases`` (non-stationary): a developer call, then a tester call, on 8 units laid
  out as 2 workers of 4 threads, each ``role:developer=2, role:tester=2``. The mix flips
  every 10 s phase (by the request's scheduled arrival): developer-heavy phases draw the
  developer from median 0.8 s and the tester from 0.08 s, tester-heavy ones the reverse
  (sigma 0.6: means 0.958 s and 0.096 s). Arrivals run at 5/s with twice that for the
  first 2 s of every phase (6/s on average), so the phase's heavy role is offered 5.7
  units (4.8 outside the burst) and the light one 0.6: 6.3 of the 8 units (79%) on
  average, yet every static split is overloaded in some phase (both roles would need 5),
  while a split that follows the phase (7 + 1) is stable.
* ``swe-free``: ``swe`` without roles: the same requests on 4 generic single-thread
  workers at 3.2 requests/s, nothing asking for a resource (a lane's retries still pay
  the rebuild away from its previous worker).

Configurations: the baselines a user would configure without this library (stock Dask,
WorkStealing on): ``default`` on the workflow's start split (even, the allocation one
would write without profiling), ``naive`` with a hand-written ``priority=`` by request
progress (the number of the request's component calls already completed), and
``static-best``, stock Dask on the best static role split found by a grid search in
hindsight (:mod:`.baselines`; skipped for a role-free workflow); then ``kvstate``
(``kvs.install`` with the library's defaults), each mechanism alone (``priority``,
``stealing``, ``capacity``), pairs and ``all``. Tables compare every row with
``default`` and with the best baseline of the same run.
A ``+hints`` suffix (``default+hints``, ``all+hints``) adds the workflow's Nalar
component hints (Table 2): in ``router`` the classifier is ``batchable`` (ready
classifications on a router worker run as one call, which costs its longest element
plus a quarter of each other one: batched decoding's price, see ``graph_opt/batch.py``);
in ``swe`` the tester is a pool of 3 sandboxes (``max-concurrency: 3``: at most three
test runs at once, cluster-wide; the rest wait on the scheduler, holding no thread).

Modules: :mod:`.components` (what a task does), :mod:`.workflows` (profiles, arrivals
and requests), :mod:`.baselines` (the baselines, offered load, grid candidates),
:mod:`.runner` (one run, repeats, the grid, the whole experiment), :mod:`.report`
(table, plot, files), :mod:`.loop_latency` (the control loop's latency under 10,000 futures),
:mod:`.loop_scale` (that latency from 10^3 to 10^5 futures over 10^3 sessions).
:mod:`.command` is the command line (``python -m dask_kvstate.bench nalar-workflows``);
asv's ``nalar_scheduling`` suite calls :func:`run_one`, :func:`grid_search` and :func:`control_loop`.
"""

from __future__ import annotations

from dask_kvstate.bench.nalar.baselines import BASELINES
from dask_kvstate.bench.nalar.loop_latency import control_loop, measure_control_loop
from dask_kvstate.bench.nalar.loop_scale import measure_control_loop_scale, scale_point
from dask_kvstate.bench.nalar.report import best_baselines
from dask_kvstate.bench.nalar.runner import CONFIGS, DEFAULT_CONFIGS, grid_search, merge_runs, run, run_one
from dask_kvstate.bench.nalar.workflows import WORKFLOWS, Workflow, configure

__all__ = [
    "BASELINES",
    "CONFIGS",
    "DEFAULT_CONFIGS",
    "WORKFLOWS",
    "Workflow",
    "best_baselines",
    "configure",
    "control_loop",
    "grid_search",
    "measure_control_loop",
    "measure_control_loop_scale",
    "merge_runs",
    "run",
    "run_one",
    "scale_point",
]
