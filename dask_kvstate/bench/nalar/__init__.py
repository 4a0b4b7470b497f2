"""Nalar's three agent workflows on Dask, with and without workflow-aware scheduling.

Each workflow is ordinary Python over futures: one coroutine per request, inside
``kvs.session``, submitting components as tasks that ask for their agent role
(``resources={"role:developer": 1}``). Components sleep for durations drawn from seeded
heavy-tailed (log-normal) profiles, so a run needs no CPU and one process holds many
single-thread workers, one unit of one role each. Requests arrive open-loop (Poisson,
seeded), and every configuration replays the very same arrivals, durations and test
outcomes, so the rows of the table differ only in scheduling.

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

Configurations: ``default`` (stock Dask, WorkStealing on, nothing of ours), each
mechanism alone (``priority``, ``stealing``, ``capacity``) and ``all``. Roles start
evenly split (the allocation one would write without profiling the workflow).
A ``+hints`` suffix (``default+hints``, ``all+hints``) adds the workflow's Nalar
component hints (Table 2): in ``router`` the classifier is ``batchable`` (ready
classifications on a router worker run as one call, which costs its longest element
plus a quarter of each other one: batched decoding's price, see ``graph_opt/batch.py``);
in ``swe`` the tester is a pool of 3 sandboxes (``max-concurrency: 3``: at most three
test runs at once, cluster-wide; the rest wait on the scheduler, holding no thread).

Modules: :mod:`.components` (what a task does), :mod:`.workflows` (profiles and
requests), :mod:`.runner` (one run, repeats, the whole experiment), :mod:`.report`
(table, plot, files), :mod:`.loop_latency` (the control loop's latency under 10,000 futures),
:mod:`.loop_scale` (that latency from 10^3 to 10^5 futures over 10^3 sessions).
``examples/nalar_workflows.py`` is the command line; asv's ``nalar_scheduling`` suite
calls :func:`run_one` and :func:`control_loop`.
"""

from __future__ import annotations

from dask_kvstate.bench.nalar.loop_latency import control_loop, measure_control_loop
from dask_kvstate.bench.nalar.loop_scale import measure_control_loop_scale, scale_point
from dask_kvstate.bench.nalar.runner import CONFIGS, DEFAULT_CONFIGS, merge_runs, run, run_one
from dask_kvstate.bench.nalar.workflows import WORKFLOWS, Workflow

__all__ = [
    "CONFIGS",
    "DEFAULT_CONFIGS",
    "WORKFLOWS",
    "Workflow",
    "control_loop",
    "measure_control_loop",
    "measure_control_loop_scale",
    "merge_runs",
    "run",
    "run_one",
    "scale_point",
]
