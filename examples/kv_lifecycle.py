"""KV lifecycle by workflow progress vs an LRU-only store, with real KV (tiny-llama).

An emulated SWE agent workflow: each session (a developer agent) materializes its own
conversation, then repeats *run the tests* (a tool call that sleeps for a seeded,
log-normal duration and uses no KV) -> *resume from the conversation with the test
report* -> *extend the conversation with report and answer*. Every repeat is a new
invocation: the client keeps only the new state's ``KVStateRef`` value and releases
its futures, as an agent loop does between turns, so between invocations only the
session (or nothing) keeps the KV. Sessions arrive staggered (at most ``--live`` at a
time) and end after ``--rounds`` invocations.

The one worker's device tier is smaller than the live sessions' KV and its host tier
is empty, so everything that leaves the device goes to the disk tier (raw bytes and a
checksum per block): on a CPU machine that is where resume latency differs, besides
recomputes. Three configurations replay the very same sessions, durations and texts:

* ``resident``: device budget large enough for everything, lifecycle off (the baseline);
* ``lru``: the small budgets, the store's own eviction score only (lifecycle off);
* ``lifecycle``: the small budgets with ``kvstate.lifecycle.enabled``.

Before the sessions, the scheduler sees one test run (steady state: the prediction
needs a history; ``--cold`` skips it). Reported per configuration: median and P90 resume latency (time to first token of
the resume task, which includes reading the state's blocks), resumes that found their
KV offloaded-then-prefetched (and their median), recomputed blocks and tokens,
peak device bytes, and the KV bytes left by ended sessions.

Run::

    python examples/kv_lifecycle.py                 # prints a markdown table
    python examples/kv_lifecycle.py --repeats 3 --out results/lifecycle   # medians of 3 interleaved runs

The experiment is :mod:`dask_kvstate.bench.kv_lifecycle`.
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
