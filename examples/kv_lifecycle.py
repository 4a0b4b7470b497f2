"""KV lifecycle by workflow progress vs an LRU-only store, with real KV (tiny-llama).

Seeded developer-agent sessions (materialize a conversation, then run the tests ->
resume with the report -> extend, a few rounds each) on one worker whose device tier
is smaller than the live sessions' KV. Three configurations replay the very same
sessions: ``resident`` (budgets large enough for everything), ``lru`` (small budgets,
the store's own eviction only) and ``lifecycle`` (small budgets with
``kvstate.lifecycle.enabled``: offload, prefetch and invalidate by predicted idle time
and session liveness). The table shows resume latency, prefetched resumes, recomputes,
peak device bytes and the KV ended sessions left behind. The experiment, in full, is
:mod:`dask_kvstate.bench.kv_lifecycle`.

Run::

    python examples/kv_lifecycle.py                 # prints a markdown table
    python examples/kv_lifecycle.py --repeats 3 --out results/lifecycle   # medians of 3 interleaved runs

The script is ``python -m dask_kvstate.bench kv-lifecycle [flags]`` (``--help`` lists the flags).
"""

from __future__ import annotations

import sys

from dask_kvstate import bench


def main(argv: list[str] | None = None):
    """``python -m dask_kvstate.bench kv-lifecycle`` with this script's arguments (``--help`` lists them)."""
    return bench.main(["kv-lifecycle", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
