"""Nalar's agent workflows on Dask, against the baselines a user would configure.

Five agent workflows (``swe``: planner, developers, testers with retries; ``analyst``:
fan-out, summary, follow-ups; ``router``: a classifier whose traffic shifts to ``code``;
``phases``: developer then tester, the heavy role flipping every 10 s phase; ``swe-free``:
``swe`` on generic workers, no roles) run as ordinary Python over futures, one
``kvs.session`` per request, components asking for their agent role. Components sleep
for seeded heavy-tailed durations and requests arrive open-loop, so every configuration
replays the very same requests and the rows differ only in scheduling. The baselines
are stock Dask: ``default`` (the even start split), ``naive`` (a hand-written
``priority=`` by request progress) and ``static-best`` (the best static role split of a
grid search in hindsight: at most ``--grid-max`` candidate splits, each run
``--grid-duration`` seconds; skipped for ``swe-free``); then ``kvstate`` (the library's
defaults), each mechanism alone (``priority``, ``stealing``, ``capacity``) and ``all``;
a ``+hints`` suffix adds the workflow's Nalar component hints (``router``: a batchable
classifier; ``swe``: at most 3 test runs at once). The workflows, runs and report are
:mod:`dask_kvstate.bench.nalar`, whose docstring describes each workflow in full.

Run::

    python examples/nalar_workflows.py --workflow swe --out results/nalar
    python examples/nalar_workflows.py --workflow phases --duration 20 --grid-max 4
    python examples/nalar_workflows.py --control-loop 10000   # control loop latency
    python examples/nalar_workflows.py --control-loop-scale 1000,10000,100000 --out docs/nalar   # vs queue size
    python examples/nalar_workflows.py --workflow router --configs default,default+hints   # batching

It prints a line per run (and per grid run), a markdown table (avg, P50, P95, P99, max
end-to-end latency in seconds; ratios against ``default`` and the best baseline of the
run) and the grid, and writes ``<out>/<workflow>.md``, ``.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import logging

from dask_kvstate.bench import nalar


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workflow", choices=[*nalar.WORKFLOWS, "all"], default="swe")
    ap.add_argument(
        "--configs",
        default=nalar.DEFAULT_CONFIGS,
        help="comma-separated, of " + ",".join(nalar.CONFIGS) + "; a +hints suffix adds the component hints",
    )
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    ap.add_argument("--drain", type=float, default=120.0, help="seconds allowed after the last arrival")
    ap.add_argument("--rate", type=float, default=None, help="requests per second (default: the workflow's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="seeds seed..seed+repeats-1, interleaved; medians")
    ap.add_argument("--roles", default=None, help="units per role at start, e.g. planner=1,developer=7,tester=4")
    ap.add_argument("--median", default=None, help="median seconds per component call, e.g. router=0.06")
    ap.add_argument(
        "--stateful",
        action="store_true",
        help="mark swe's developer stateful: its retries keep session affinity (Nalar's stateful hint)",
    )
    ap.add_argument("--grid-max", type=int, default=10, help="static-best: candidate splits run at most")
    ap.add_argument(
        "--grid-duration",
        type=float,
        default=None,
        help="static-best: seconds of arrivals a grid run (default: --duration)",
    )
    ap.add_argument("--out", default="results/nalar")
    ap.add_argument("--control-loop", type=int, default=0, metavar="N", help="measure the loop with N queued futures")
    ap.add_argument(
        "--control-loop-scale",
        nargs="?",
        const="1000,10000,100000",
        default=None,
        metavar="N,N,...",
        help="the loop's pass against queued futures (over 1000 sessions, 100 workers); sizes comma-separated",
    )
    args = ap.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)  # cluster start/stop chatter, per run
    if args.control_loop_scale:
        nalar.measure_control_loop_scale([int(n) for n in args.control_loop_scale.split(",")], args.out)
        return
    if args.control_loop:
        nalar.measure_control_loop(args.control_loop, args.out)
        return
    nalar.run(
        args.workflow,
        configs=args.configs,
        duration=args.duration,
        drain=args.drain,
        rate=args.rate,
        seed=args.seed,
        repeats=args.repeats,
        roles=args.roles,
        median=args.median,
        stateful=args.stateful,
        grid_max=args.grid_max,
        grid_duration=args.grid_duration,
        out=args.out,
    )


if __name__ == "__main__":
    main()
