"""A KV-heavy SWE agent workflow with real KV (tiny-llama) against the baselines a user would configure.

Seeded open-loop requests, one ``kvs.session`` each: a planner prefills the request's own
long context, 2-3 developer lanes resume from it, a tester tool call per attempt sends a
failed lane back to resume from its grown conversation. Configurations replay the very
same requests: ``default`` (KV store and placement, stock Dask scheduling), ``naive``
(the same with hand-set progress priorities), ``kvstate`` (``kvs.install`` defaults) and
``all`` (scheduling and lifecycle on). The table gives end-to-end latency, ratios against
the best baseline, what the KV-aware policies decided, and whether KV reuse stayed
token-identical to text replay. The experiment, in full, is
:mod:`dask_kvstate.bench.nalar.kv_heavy`.

Run::

    python examples/nalar_kv.py --duration 20 --repeats 1 --out results/kv
    python examples/nalar_kv.py --repeats 3 --configs default,kvstate   # medians of 3 interleaved runs
"""

from __future__ import annotations

import argparse

from dask_kvstate.bench.nalar import kv_heavy


def main(argv=None) -> list[dict]:
    d = kv_heavy.Options()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of arrivals")
    p.add_argument("--rate", type=float, default=d.rate, help="requests per second (Poisson)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--repeats", type=int, default=d.repeats, help="runs per config, interleaved; the table shows medians"
    )
    p.add_argument("--configs", default=d.configs, help=f"comma-separated, of {','.join(kv_heavy.CONFIGS)}")
    p.add_argument("--out", default=d.out, help="folder for kv.md and kv.json")
    args = p.parse_args(argv)
    return kv_heavy.run(kv_heavy.Options(**vars(args)))


if __name__ == "__main__":
    main()
