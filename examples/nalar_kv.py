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

The script is ``python -m dask_kvstate.bench nalar-kv [flags]`` (``--help`` lists the flags).
"""

from __future__ import annotations

import sys

from dask_kvstate import bench


def main(argv: list[str] | None = None):
    """``python -m dask_kvstate.bench nalar-kv`` with this script's arguments (``--help`` lists them)."""
    return bench.main(["nalar-kv", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
