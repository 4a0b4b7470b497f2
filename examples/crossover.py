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
"""

from __future__ import annotations

import argparse

from dask_kvstate.bench import crossover, crossover_netns


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--protocol", default="tcp", help="comm of the sweep's cluster: tcp, tls or ucx")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--throughput", default="tcp", help="comma-separated comms to measure KV pull throughput on")
    ap.add_argument("--mib", type=int, default=64, help="bytes of KV moved per throughput measurement")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--packed", action="store_true", help="also time pulls with the zero-copy path off, interleaved")
    ap.add_argument(
        "--checksum", action="store_true", help="also time pulls with frame checksums off and on, interleaved"
    )
    ap.add_argument("--tp-repeats", type=int, default=9, help="pulls and fetches per throughput measurement")
    ap.add_argument("--links", choices=["throttle", "netns"], default="throttle", help="the sweep's links")
    ap.add_argument("--contexts", type=int, nargs="+", default=crossover_netns.CONTEXTS, help="--links netns contexts")
    ap.add_argument("--out", default="results/crossover-netns", help="where --links netns writes its table")
    args = ap.parse_args(argv)
    if args.links == "netns":
        res = crossover_netns.compare(args.model, args.repeats, contexts=args.contexts)
        print(crossover_netns.write(res, args.out))
        return res
    cells = [] if args.skip_sweep else crossover.sweep(args.model, args.protocol, args.repeats)
    protocols = list(filter(None, args.throughput.split(",")))
    rates = crossover.throughputs(
        args.model, protocols, args.mib, args.tp_repeats, packed=args.packed, checksum=args.checksum
    )
    return {"cells": cells, "throughput": rates}


if __name__ == "__main__":
    main()
