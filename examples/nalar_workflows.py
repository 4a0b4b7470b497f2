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

The script is ``python -m dask_kvstate.bench nalar-workflows [flags]`` (``--help`` lists the flags).
"""

from __future__ import annotations

import sys

from dask_kvstate import bench


def main(argv: list[str] | None = None):
    """``python -m dask_kvstate.bench nalar-workflows`` with this script's arguments (``--help`` lists them)."""
    return bench.main(["nalar-workflows", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
