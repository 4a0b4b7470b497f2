"""Tree of thought: k branches explore one shared context, three ways, measured.

Every branch reads the same incident report (~1,500 tokens at 52 log lines) and answers
its own question. ``replay`` prefills the whole report once per branch; ``kvstate``
materializes it once, forks the state, and each branch resumes from it (pulling the
blocks when it runs on another worker); ``compiler`` runs the text-replay code under
``kvs.stateflow()``, which inserts the state tasks by itself. :func:`table` compares
per-branch time to first token, total wall time, KV bytes and whether outputs are
token-identical. :func:`command` is ``python -m dask_kvstate.bench tree-of-thought`` (``make demo``,
``examples/tree_of_thought.py``), on SmolLM2 by default.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate import progress
from dask_kvstate.backends import check_model_name, describe_known
from dask_kvstate.bench import workload

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
    """The shared context: a fixed head and ``lines`` deterministic log lines.

    >>> report(2).count("checkout-")
    2
    """
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


def _replay(parts, new_tokens):
    return [kvs.generate(p, s, max_new_tokens=new_tokens) for p, s in parts]


def _explicit(parts, new_tokens):
    # Its own namespace, so it cannot profit from blocks the compiler run left behind.
    state = kvs.materialize(parts[0][0], namespace="explicit")
    return [kvs.resume(ref, s, max_new_tokens=new_tokens) for ref, (_, s) in zip(kvs.fork(state, len(parts)), parts)]


MODES = {  # name -> (build the outputs, use the compiler)
    "replay": (_replay, False),
    "kvstate": (_explicit, False),
    "compiler": (_replay, True),  # the text-replay code, compiled to stateflow
}


def run(client: Client, *, branches: int = 4, lines: int = 52, new_tokens: int = 32) -> dict:
    """Text replay, explicit kvstate operators, and the compiler, one after the other.

    Returns, per mode, the results, wall time, the worker of each branch and the deltas
    of the prefill, transfer and held-bytes counters; plus the context's token count and
    the model's KV bytes per token. Raises ValueError for ``branches`` outside
    ``1..len(QUESTIONS)``.
    """
    if not 1 <= branches <= len(QUESTIONS):
        raise ValueError(f"branches must be in 1..{len(QUESTIONS)}, got {branches}")
    parts = [prompt_parts(lines, q) for q in QUESTIONS[:branches]]
    client.run(workload.warm_up)  # warm every worker's kernels so no mode pays first-call costs
    m: dict = {"context_tokens": None}
    for name, (build, compiled) in MODES.items():
        outs = build(parts, new_tokens)
        before, t0 = kvs.stats(client).workers, time.perf_counter()
        with kvs.stateflow() if compiled else contextlib.nullcontext():
            futures = client.compute(outs)
            for _ in progress.as_completed(futures, desc=f"{name}: {len(futures)} branches"):
                pass
            results = client.gather(futures)
        wall, after = time.perf_counter() - t0, kvs.stats(client).workers
        where = client.who_has(futures)
        m[name] = {
            "results": results,
            "wall": wall,
            "workers": [next(iter(where[f.key]), "?") for f in futures],
            "prefill_tokens": _delta(after, before, "prefill_tokens"),
            "transfer_bytes": _delta(after, before, "transfer_bytes"),
            "held_bytes": _delta(after, before, "bytes"),
        }
    m["context_tokens"] = m["kvstate"]["results"][0].reused_tokens + 1
    m["bytes_per_token"] = workload.kv_bytes_per_token(client)
    return m


def _delta(a: dict, b: dict, counter: str) -> int:
    return sum(a[w].get(counter, 0) - b.get(w, {}).get(counter, 0) for w in a)


def identical(m: dict) -> bool:
    """Whether every mode of a :func:`run` produced the same token ids for every branch."""
    ids = [[g.token_ids for g in m[name]["results"]] for name in MODES]
    return all(x == ids[0] for x in ids)


def table(m: dict) -> str:
    """A :func:`run` as a text table: per-branch TTFT, then wall time and KV bytes per mode."""
    mib = 2**20
    rep, kv, cc = (m[n] for n in MODES)
    context_mib = m["context_tokens"] * m["bytes_per_token"] / mib
    rows = [
        f"shared context: {m['context_tokens']} tokens, {context_mib:.1f} MiB of KV; {len(rep['results'])} branches",
        "",
        f"{'branch':>6} | {'TTFT replay':>11} | {'TTFT kvstate':>12} | {'TTFT compiler':>13} | {'speedup':>7} | "
        "identical",
        "-" * 78,
    ]
    for i, (r, k, c) in enumerate(zip(rep["results"], kv["results"], cc["results"])):
        same = "yes" if r.token_ids == k.token_ids == c.token_ids else "NO"
        rows.append(
            f"{i:>6} | {r.ttft:>9.3f} s | {k.ttft:>10.3f} s | {c.ttft:>11.3f} s | {r.ttft / k.ttft:>6.1f}x | {same}"
        )
    prefill = {n: m[n]["prefill_tokens"] * m["bytes_per_token"] / mib for n in MODES}
    rows += [
        "-" * 78,
        f"{'total wall time':>24} | {rep['wall']:>9.2f} s | {kv['wall']:>10.2f} s | {cc['wall']:>11.2f} s | "
        f"{rep['wall'] / kv['wall']:>6.2f}x |",
        f"{'KV bytes prefilled':>24} | {prefill['replay']:>7.1f} MiB | {prefill['kvstate']:>8.1f} MiB | "
        f"{prefill['compiler']:>9.1f} MiB | {prefill['replay'] / max(prefill['kvstate'], 1e-9):>6.2f}x |",
        f"{'KV moved between workers':>24} | {0:>7.1f} MiB | {kv['transfer_bytes'] / mib:>8.1f} MiB | "
        f"{cc['transfer_bytes'] / mib:>9.1f} MiB |",
        f"{'KV held after (stores)':>24} | {rep['held_bytes'] / mib:>7.1f} MiB | {kv['held_bytes'] / mib:>8.1f} MiB | "
        f"{cc['held_bytes'] / mib:>9.1f} MiB |",
        "",
        f"token-identical outputs: {'all' if identical(m) else 'NOT ALL'}",
        f"branch 0 says: {kv['results'][0].strip()!r}",
    ]
    return "\n".join(rows)


@dataclass
class Options:
    """The demo's settings: the model, the cluster and the tree."""

    model: str = field(default="smollm2-135m", metadata={"help": f"one of: {describe_known()}"})
    workers: int = field(default=2, metadata={"help": "worker processes, one thread each"})
    branches: int = field(default=4, metadata={"help": f"branches, one question each (at most {len(QUESTIONS)})"})
    lines: int = field(default=52, metadata={"help": "log lines in the shared report (52: ~1,500 tokens)"})
    new_tokens: int = field(default=32, metadata={"help": "tokens each branch generates"})

    def __post_init__(self):
        check_model_name(self.model)  # before a cluster starts, not in each worker
        if not 1 <= self.branches <= len(QUESTIONS):
            raise ValueError(f"branches must be in 1..{len(QUESTIONS)}, got {self.branches}")


def command(opts: Options) -> dict:
    """Start a cluster, install the model, :func:`run` the three modes and print :func:`table`."""
    with (
        LocalCluster(n_workers=opts.workers, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        t0 = time.perf_counter()
        print(f"loading {opts.model} on {opts.workers} workers ...", flush=True)
        kvs.install(client, opts.model, torch_threads=1)
        print(f"loaded in {time.perf_counter() - t0:.1f} s; running {opts.branches} branches three ways", flush=True)
        m = run(client, branches=opts.branches, lines=opts.lines, new_tokens=opts.new_tokens)
    print(table(m))
    return m
