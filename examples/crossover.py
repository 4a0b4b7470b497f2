"""Transfer versus recompute, measured: emulated link speed x context length.

For every cell the worker that needs a state held elsewhere asks the rule (its live
measurements: pull bandwidth and latency per peer, prefill cost of its model), then
both options are really carried out and timed. The rule is right when it picked the
faster of the two measured times. Also measures KV pull throughput against a raw Dask
transfer of a numpy array of the same bytes, on the same link, in the same run. The
measurements are :mod:`dask_kvstate.bench.crossover`.

Run: ``python examples/crossover.py [--model tiny-llama] [--protocol tcp] [--throughput tcp,ucx]``.
With ``--links netns`` (root, Linux) the sweep runs over real links between network
namespaces shaped with htb (:mod:`dask_kvstate.bench.crossover_netns`), beside the config
throttle on the same cells, and writes ``cells.json`` and ``table.md`` to ``--out``.

The script is ``python -m dask_kvstate.bench crossover-sweep [flags]`` (``--help`` lists the flags).
"""

from __future__ import annotations

import sys

from dask_kvstate import bench


def main(argv: list[str] | None = None):
    """``python -m dask_kvstate.bench crossover-sweep`` with this script's arguments (``--help`` lists them)."""
    return bench.main(["crossover-sweep", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
