"""kvstate over vLLM against what a vLLM user would run instead, side by side in one run.

::

    python -m dask_kvstate.bench vllm-rows --out results/vllm          # SmolLM2, L = 4,096
    python -m dask_kvstate.bench vllm-rows --length 1024 --agents 8    # a shorter run

Two Dask workers, one vLLM engine each (each bound to its own core), and the baselines:

- **vLLM local prefix caching on each worker**: Dask places the requests, every engine
  keeps its own prefix cache, no KV moves (the AAFLOW+ paper's "vLLM local prefix");
- **one vLLM engine given both cores** (one worker), prefix caching on;
- with ``--shared-cores``, the agents rows again with both engines given both cores:
  once sharing them (``kvstate.vllm.share-cores``, the default: an engine stepping alone
  runs on both, two stepping at once one each) and once each always on both;
- **a prefix-cache hit on a single engine** (the floor for a branch's TTFT);
- **kvstate over vLLM**: the state made once on one worker, its blocks pulled by the
  other and loaded into that engine by our connector;
- **kvstate over transformers** on the agents workload (two workers x one thread), for
  which backend to use: its outputs are counted against vLLM's, not required to equal them.

Every output of a kvstate row is checked token for token against the same prompt's
replay on the same engine build; a mismatch stops the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import dask
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.bench import crossover, workload
from dask_kvstate.bench.vllm_table import table
from dask_kvstate.protocol import WORKER_PLUGIN


def _reset(client, workers: list[str] | None = None, settle: bool = True) -> None:
    """Empty the engines' prefix caches and the block stores: every row starts cold.

    With ``settle``, once the last row's tasks are forgotten: until then their pins keep
    blocks in a store, and a materialize finding them there would leave its engine
    without the prefix (a "hit" that prefilled).
    """
    if settle:
        workload.settle(client)
    client.run(workload._reset, workers=workers)


def _pin(cores: tuple[int, ...], dask_worker=None) -> None:
    """Every thread of this worker process on ``cores`` (threads made later inherit it).

    ``os.sched_setaffinity(0, ...)`` would pin only the calling thread, the event loop:
    the comm's offload thread and others made before would still run on every core.
    """
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), set(cores))


def _engine(client) -> dict:
    return {w: dict(s["engine"]) for w, s in kvs.stats(client).workers.items()}


def _prompt_tokens(client) -> dict:
    """Per worker, the prompt tokens its model computed so far: a vLLM engine's count
    (requests' prompts less its prefix-cache hits and our loads), else the runtime's."""
    return {
        w: s["engine"]["computed_tokens"] if "computed_tokens" in s["engine"] else s.get("prefill_tokens", 0)
        for w, s in kvs.stats(client).workers.items()
    }


def _computed(before: dict, after: dict) -> int:
    """Prompt tokens computed between two :func:`_prompt_tokens` snapshots."""
    return sum(after[w] - before.get(w, 0) for w in after)


def on(worker):
    return dask.annotate(workers=[worker], allow_other_workers=False)


def _cluster(n_workers: int, cores: list[set[int]]):
    cluster = LocalCluster(n_workers=n_workers, threads_per_worker=16, processes=True, dashboard_address=":0")
    client = Client(cluster)
    workers = sorted(client.nthreads())
    for w, core_set in zip(workers, cores):
        client.run(_pin, tuple(core_set), workers=[w])
    kvs.install(client, "smollm2-135m", backend="vllm")
    return cluster, client, workers


def branch_ttft(client, a: str, b: str, context: str, repeats: int) -> dict:
    """TTFT of a branch on worker B, which does not hold the state made on A.

    One round first, not counted: a worker's first pull lands in memory its process
    never touched, and on a VM the first touch of such pages is slow (179 MiB pulled in
    0.43 s the first time, 0.06 s after; a fresh clone of it 0.51 s, then 0.07 s), which
    would time the machine's warm-up rather than the path.
    """
    rows: dict[str, list[float]] = {"vllm_local_prefill_on_b": [], "kvstate_pull_into_b": [], "single_engine_hit": []}
    for r in range(repeats + 1):  # round 0 is the warm-up
        _reset(client)
        sfx, sfx2 = workload.suffix(2 * r), workload.suffix(2 * r + 1)
        with on(b):
            cold = kvs.generate(context, sfx, max_new_tokens=4).compute()
        _reset(client)
        with on(a):
            state = client.persist(kvs.materialize(context))
        state.compute()
        with on(b):
            resumed = kvs.resume(state, sfx, max_new_tokens=4).compute()
        _check_ids([resumed.token_ids], [cold.token_ids], "branch on B")
        with on(a):  # A's engine holds the prefix: a plain request hits its prefix cache
            hit = kvs.generate(context, sfx2, max_new_tokens=4).compute()
        del state
        if r > 0:
            rows["vllm_local_prefill_on_b"].append(cold.ttft)
            rows["kvstate_pull_into_b"].append(resumed.ttft)
            rows["single_engine_hit"].append(hit.ttft)
    return {k: statistics.median(v) for k, v in rows.items()}


def agents_wall(client, workers: list[str], context: str, agents: int, new_tokens: int, mode: str) -> dict:
    """``agents`` requests sharing ``context``, spread over ``workers``: wall time and prompt tokens computed."""
    _reset(client)
    before = _prompt_tokens(client)
    suffixes = [workload.suffix(i) for i in range(agents)]
    t0 = time.perf_counter()
    if mode == "kvstate":
        with on(workers[0]):
            state = kvs.materialize(context)
        outs = []
        for j, w in enumerate(workers):
            with on(w):
                outs += kvs.resume_many(state, suffixes[j :: len(workers)], max_new_tokens=new_tokens)
        got = dask.compute(*outs)
        order = [i for j in range(len(workers)) for i in range(j, agents, len(workers))]
    else:
        outs = []
        for i, s in enumerate(suffixes):
            with on(workers[i % len(workers)]):
                outs.append(kvs.generate(context, s, max_new_tokens=new_tokens))
        got = dask.compute(*outs)
        order = list(range(agents))
    wall = time.perf_counter() - t0
    after = _prompt_tokens(client)
    by_agent = dict(zip(order, got))
    return {
        "wall_s": wall,
        "computed_prompt_tokens": _computed(before, after),
        "outputs": [by_agent[i].token_ids for i in range(agents)],
    }


def agents_rows(client, workers: list[str], context: str, agents: int, new_tokens: int, modes, repeats: int) -> dict:
    """:func:`agents_wall` for each of ``modes``, interleaved, ``repeats`` times: per mode the
    median wall (every run's in ``walls``); every run's outputs must equal the first's."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(repeats):
        for m in modes:
            runs[m].append(agents_wall(client, workers, context, agents, new_tokens, m))
    rows = {}
    for m, got in runs.items():
        for r in got[1:]:
            _check_ids(r["outputs"], got[0]["outputs"], f"{agents} agents, {m}, a repeat")
        walls = [r["wall_s"] for r in got]
        rows[m] = {**got[0], "wall_s": statistics.median(walls), "walls": walls}
    return rows


def hf_agents_row(context: str, agents: int, new_tokens: int, repeats: int) -> dict:
    """kvstate over the transformers backend on the same agents workload, for which backend
    to use: two workers x one thread (a long prefill borrows the idle one's), each worker's
    siblings decoded as one batch whose attention reads the shared prefix once a step
    (vLLM's CPU attention reads it once per row)."""
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
    client = Client(cluster)
    try:
        kvs.install(client, "smollm2-135m", torch_threads=1)
        client.run(workload.warm_up)
        workers = sorted(client.nthreads())
        return agents_rows(client, workers, context, agents, new_tokens, ["kvstate"], repeats)["kvstate"]
    finally:
        client.close()
        cluster.close()


def transfer(client, a: str, b: str, context: str) -> dict:
    """Our pull of a state's blocks (into B's store) and our connector's copy of them into B's
    engine, against Dask's own fetch of a numpy array of the same bytes, A to B."""
    _reset(client)
    rates = crossover.throughput(client, a, b, _state_bytes(client, a, context))
    before = _engine(client)[b]
    with on(a):
        state = client.persist(kvs.materialize(context))
    _reset(client, workers=[b], settle=False)  # the state persisted on A stays
    with on(b):
        kvs.resume(state, workload.suffix(0), max_new_tokens=1).compute()
    after = _engine(client)[b]
    load_s = after.get("load_s", 0.0) - before.get("load_s", 0.0)
    loaded = after.get("loaded_tokens", 0) - before.get("loaded_tokens", 0)
    per_token = workload.kv_bytes_per_token(client)
    into_engine_s = rates["kv_s"] + load_s * rates["mib"] * 2**20 / max(1, loaded * per_token)
    return {
        **{k: rates[k] for k in ("mib", "kv_s", "raw_s", "ratio", "paired_ratio")},
        "engine_load_s": load_s,
        "engine_load_mib": loaded * per_token / 2**20,
        "into_engine_ratio": rates["raw_s"] / into_engine_s,
    }


def _state_bytes(client, a: str, context: str) -> int:
    tokens = client.run(
        lambda dask_worker: len(dask_worker.plugins[WORKER_PLUGIN].runtime.backend.tokenize(context)), workers=[a]
    )[a]
    return tokens * workload.kv_bytes_per_token(client)


def arrivals(client, a: str, b: str, context: str, readers: int, mode: str) -> dict:
    """Readers of one document arriving one after another on alternating workers: mean TTFT."""
    _reset(client)
    ttfts, outs = [], []
    state = None
    for i in range(readers):
        w = (a, b)[i % 2]
        with on(w):
            if mode == "kvstate":
                if state is None:
                    with on(a):
                        state = client.persist(kvs.materialize(context))
                g = kvs.resume(state, workload.suffix(i), max_new_tokens=4).compute()
            else:
                g = kvs.generate(context, workload.suffix(i), max_new_tokens=4).compute()
        ttfts.append(g.ttft)
        outs.append(g.token_ids)
    return {"mean_ttft_s": statistics.fmean(ttfts), "ttfts": ttfts, "outputs": outs}


MODES = ("local", "kvstate")


@dataclass
class Options:
    """The workload's shape, the repeats of each row, where the results go."""

    length: int = field(default=4096, metadata={"help": "shared context tokens"})
    agents: int = field(default=16, metadata={"help": "agents over the shared context"})
    new_tokens: int = field(default=64, metadata={"help": "tokens each agent generates"})
    readers: int = field(default=6, metadata={"help": "readers arriving on alternating workers"})
    repeats: int = field(default=3, metadata={"help": "rounds of the branch TTFT row (medians)"})
    agent_repeats: int = field(default=3, metadata={"help": "runs of each agents row, interleaved (medians)"})
    out: Path = field(default=Path("results/vllm"), metadata={"help": "folder for vllm_rows.json and table.md"})
    shared_cores: bool = field(
        default=False,
        metadata={"help": "also run the agents rows with both engines given both cores, sharing them and not"},
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m dask_kvstate.bench.vllm_rows``: the same as ``python -m dask_kvstate.bench vllm-rows``."""
    from dask_kvstate.bench.registry import main as bench

    bench(["vllm-rows", *(sys.argv[1:] if argv is None else argv)])


def command(opts: Options) -> dict:
    """Every row, each checked against vLLM's own replay; writes ``vllm_rows.json`` and ``table.md`` to ``out``."""
    opts.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"length": opts.length, "n_agents": opts.agents, "new_tokens": opts.new_tokens}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    cluster, client, (a, b) = _cluster(2, [{0}, {1}])
    try:
        context = workload.contexts(client, [opts.length])[opts.length]
        print("branch TTFT on the worker without the state ...", flush=True)
        results["branch_ttft"] = branch_ttft(client, a, b, context, opts.repeats)
        print(results["branch_ttft"], flush=True)
        print(f"{opts.agents} agents over both workers ...", flush=True)
        rows = agents_rows(client, [a, b], context, opts.agents, opts.new_tokens, MODES, opts.agent_repeats)
        local, ours = rows["local"], rows["kvstate"]
        _check_ids(ours["outputs"], local["outputs"], "16 agents")
        results["agents"] = {"vllm_local_prefix_each_worker": local, "kvstate": ours}
        print("KV pull into the engine vs Dask's own transfer of the same bytes ...", flush=True)
        results["transfer"] = transfer(client, a, b, context)
        print("readers arriving on alternating workers ...", flush=True)
        r_local = arrivals(client, a, b, context, opts.readers, "local")
        r_ours = arrivals(client, a, b, context, opts.readers, "kvstate")
        _check_ids(r_ours["outputs"], r_local["outputs"], "arrivals")
        results["arrivals"] = {"vllm_local_prefix_each_worker": r_local, "kvstate": r_ours}
    finally:
        client.close()
        cluster.close()

    cluster, client, (solo,) = _cluster(1, [{0, 1}])
    try:
        one = agents_rows(client, [solo], context, opts.agents, opts.new_tokens, ["local"], opts.agent_repeats)["local"]
        _check_ids(one["outputs"], results["agents"]["vllm_local_prefix_each_worker"]["outputs"], "one engine")
        results["agents"]["one_engine_both_cores"] = one
    finally:
        client.close()
        cluster.close()

    print(f"{opts.agents} agents, kvstate over transformers ...", flush=True)
    hf = hf_agents_row(context, opts.agents, opts.new_tokens, opts.agent_repeats)
    # Other kernels, so not checked against vLLM's replay: counted (the transformers
    # backend's own reuse paths are checked against its replay by its tests and bench).
    hf["same_as_vllm"] = sum(g == w for g, w in zip(hf["outputs"], one["outputs"]))
    results["agents"]["kvstate_over_transformers"] = hf

    if opts.shared_cores:
        both = os.sched_getaffinity(0)  # every core this process may use
        for key, share in (("agents_shared_cores", True), ("agents_shared_cores_unshared", False)):
            with dask.config.set({"kvstate.vllm.share-cores": share}):  # read by each worker's engine at start
                cluster, client, workers = _cluster(2, [both, both])
            try:
                shared = agents_rows(client, workers, context, opts.agents, opts.new_tokens, MODES, opts.agent_repeats)
                for m in MODES:
                    _check_ids(shared[m]["outputs"], one["outputs"], f"engines on both cores, {m}, share {share}")
                results[key] = shared
            finally:
                client.close()
                cluster.close()

    (opts.out / "vllm_rows.json").write_text(json.dumps(results, indent=1))
    (opts.out / "table.md").write_text(table(results))
    print(table(results))
    return results


def _check_ids(got: list, want: list, what: str) -> None:
    if got != want:
        bad = sum(g != w for g, w in zip(got, want))
        raise AssertionError(f"{what}: {bad} of {len(want)} outputs differ from vLLM's own replay")


if __name__ == "__main__":
    main()
