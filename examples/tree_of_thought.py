"""Tree of thought on Dask: k branches explore one shared context, text replay vs kvstate.

Every branch reads the same incident report (~1,500 tokens) and answers its own
question. Text replay prefills the whole report once per branch; kvstate prefills it
once, forks the state, and each branch resumes from it (pulling the blocks when it
runs on another worker). The table compares per-branch time to first token, total
wall time, KV bytes and whether outputs are token-identical.

Run: ``make demo`` or ``python examples/tree_of_thought.py [--model tiny-llama]``.
"""
from __future__ import annotations

import argparse
import time

import dask
from distributed import Client, LocalCluster

import dask_kvstate as kvs

SYSTEM = "You are a senior site reliability engineer. Read the incident report and answer briefly."

REPORT_HEAD = """\
Incident report INC-2291: intermittent timeouts in the checkout service.
Summary: between 09:12 and 11:47 UTC, about 4% of checkout requests timed out after 30 seconds.
The payment gateway, the inventory service and the session store were all reachable.
The on-call engineer restarted two pods at 10:03, which helped for eleven minutes only.
A config change to the connection pool (max size 64 -> 16) had shipped at 09:05.
Database CPU stayed under 40%, but the p99 latency of the orders table rose from 8 ms to 950 ms.
Below are the relevant log lines from the checkout workers, in order.
"""

QUESTIONS = [
    "What is the most likely root cause? Answer in one sentence.",
    "Which single metric would have caught this earliest, and why?",
    "Propose one immediate mitigation the on-call engineer can apply now.",
    "Write a one-line title for the postmortem.",
    "Which team should own the follow-up action?",
    "Was the pod restart a good idea? Explain briefly.",
    "What should the alert threshold be for pool wait time?",
    "Name one test that would have prevented this change from shipping.",
]


def report(lines: int) -> str:
    """The shared context: a fixed head and ``lines`` deterministic log lines."""
    out = [REPORT_HEAD]
    for i in range(lines):
        worker, wait = i % 7, (i * 37) % 900 + 12
        status = "TIMEOUT" if i % 9 == 4 else "ok"
        out.append(f"09:{12 + i // 60:02d}:{i % 60:02d} checkout-{worker} pool_wait={wait}ms orders_query {status}\n")
    return "".join(out)


def prompt_parts(lines: int, question: str) -> tuple[str, str]:
    """(shared prefix, branch suffix) in SmolLM2's chat format."""
    prefix = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{report(lines)}\n"
    suffix = f"Question: {question}<|im_end|>\n<|im_start|>assistant\n"
    return prefix, suffix


def run(client: Client, *, branches: int = 4, lines: int = 52, new_tokens: int = 32) -> dict:
    """Both ways, one after the other, on the same cluster; returns the measurements."""
    if not 1 <= branches <= len(QUESTIONS):
        raise ValueError(f"branches must be in 1..{len(QUESTIONS)}, got {branches}")
    parts = [prompt_parts(lines, q) for q in QUESTIONS[:branches]]
    prefix = parts[0][0]
    # Warm every worker's kernels so neither side pays first-call costs.
    client.run(_warm_up)

    before = kvs.stats(client)
    t0 = time.perf_counter()
    replay = dask.compute(*[kvs.generate(p, s, max_new_tokens=new_tokens) for p, s in parts])
    t_replay = time.perf_counter() - t0
    mid = kvs.stats(client)

    t0 = time.perf_counter()
    state = kvs.materialize(prefix)
    branches_ = [kvs.resume(ref, s, max_new_tokens=new_tokens) for ref, (_, s) in zip(kvs.fork(state, branches), parts)]
    futures = client.compute([state, *branches_])
    ref, *reused = client.gather(futures)
    t_kv = time.perf_counter() - t0
    after = kvs.stats(client)
    where = client.who_has(futures[1:])

    bytes_per_token = ref.nbytes // ref.num_tokens
    return {
        "replay": replay, "kvstate": reused, "ref": ref, "t_replay": t_replay, "t_kvstate": t_kv,
        "workers": [next(iter(where[f.key]), "?") for f in futures[1:]],
        "replay_prefill_bytes": _delta(mid, before, "prefill_tokens") * bytes_per_token,
        "kvstate_prefill_bytes": _delta(after, mid, "prefill_tokens") * bytes_per_token,
        "kvstate_resident_bytes": sum(s.get("bytes", 0) for s in after.values()),
        "transfer_bytes": _delta(after, mid, "transfer_bytes"),
    }  # fmt: skip


def _warm_up(dask_worker) -> None:
    dask_worker.plugins["kvstate"].runtime.backend.generate([1, 2, 3], max_new_tokens=2)


def _delta(a: dict, b: dict, counter: str) -> int:
    return sum(a[w].get(counter, 0) - b.get(w, {}).get(counter, 0) for w in a)


def table(m: dict) -> str:
    mib = 2**20
    rows = [
        f"shared context: {m['ref'].num_tokens} tokens, {len(m['ref'].blocks)} blocks, "
        f"{m['ref'].nbytes / mib:.1f} MiB of KV",
        "",
        f"{'branch':>6} | {'worker':>22} | {'TTFT replay':>11} | {'TTFT kvstate':>12} | {'speedup':>7} | identical",
        "-" * 82,
    ]
    for i, (r, k, w) in enumerate(zip(m["replay"], m["kvstate"], m["workers"])):
        same = "yes" if r.token_ids == k.token_ids else "NO"
        rows.append(f"{i:>6} | {w:>22} | {r.ttft:>9.3f} s | {k.ttft:>10.3f} s | {r.ttft / k.ttft:>6.1f}x | {same}")
    rows += [
        "-" * 82,
        f"{'total wall time':>31} | {m['t_replay']:>9.2f} s | {m['t_kvstate']:>10.2f} s | "
        f"{m['t_replay'] / m['t_kvstate']:>6.2f}x |",
        f"{'KV bytes prefilled':>31} | {m['replay_prefill_bytes'] / mib:>7.1f} MiB | "
        f"{m['kvstate_prefill_bytes'] / mib:>8.1f} MiB | {m['replay_prefill_bytes'] / max(m['kvstate_prefill_bytes'], 1):>6.2f}x |",
        f"{'KV bytes held after (stores)':>31} | {0:>7.1f} MiB | {m['kvstate_resident_bytes'] / mib:>8.1f} MiB |",
        f"{'KV bytes moved between workers':>31} | {0:>7.1f} MiB | {m['transfer_bytes'] / mib:>8.1f} MiB |",
        "",
        "token-identical outputs: "
        + ("all" if all(r.token_ids == k.token_ids for r, k in zip(m["replay"], m["kvstate"])) else "NOT ALL"),
        f"branch 0 says: {m['kvstate'][0].strip()!r}",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny-llama or a model folder")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--lines", type=int, default=52, help="log lines in the shared report (52: ~1,500 tokens)")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            t0 = time.perf_counter()
            print(f"loading {args.model} on {args.workers} workers ...", flush=True)
            kvs.install(client, args.model, torch_threads=1)
            print(f"loaded in {time.perf_counter() - t0:.1f} s; running {args.branches} branches both ways", flush=True)
            m = run(client, branches=args.branches, lines=args.lines, new_tokens=args.new_tokens)
    print(table(m))
    return m


if __name__ == "__main__":
    main()
