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
"""

from __future__ import annotations

import argparse

from dask_kvstate.bench import kv_lifecycle


def main(argv=None) -> list[dict]:
    d = kv_lifecycle.Options()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--live", type=int, default=d.live, help="sessions running at once")
    p.add_argument("--rounds", type=int, default=d.rounds, help="test-and-retry invocations per session")
    p.add_argument("--tool-seconds", type=float, default=d.tool_seconds, help="median test-run duration")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens)
    p.add_argument("--block-tokens", type=int, default=d.block_tokens)
    p.add_argument("--device-bytes", type=int, default=d.device_bytes, help="device tier budget (small configs)")
    p.add_argument("--disk-bytes", type=int, default=d.disk_bytes, help="disk tier budget (small configs)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--configs", default=d.configs)
    p.add_argument("--out", default=d.out, help="folder for lifecycle.md and lifecycle.json")
    p.add_argument("--cold", action="store_true", help="no tester run before the sessions: no history to predict from")
    p.add_argument(
        "--repeats", type=int, default=d.repeats, help="runs per config, interleaved; the table shows medians"
    )
    args = p.parse_args(argv)
    return kv_lifecycle.run(kv_lifecycle.Options(**vars(args)))


if __name__ == "__main__":
    main()
