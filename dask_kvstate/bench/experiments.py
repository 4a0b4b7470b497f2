"""The AAFLOW+ section 6 experiments, each baseline really run in the same session.

Every function takes a connected client with the model installed (except the
crossover one, which starts its own clusters because what it varies is the cluster
itself) and returns plain dicts for :mod:`dask_kvstate.bench.report`. Experiment 5b,
the plugins' cost on a graph with no LLM in it, is :mod:`dask_kvstate.bench.overhead`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import dask

from dask_kvstate import progress
from dask_kvstate.bench import crossover, workload
from dask_kvstate.protocol import WORKER_PLUGIN

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from distributed import Client

# name -> (mode, batch): batch None = siblings split evenly over workers, 1 = no batching
VARIANTS = {
    "replay": ("replay", None),
    "prefix": ("prefix", None),
    "kvstate": ("kvstate", None),
    "kvstate-unbatched": ("kvstate", 1),
}


def _read_engine_prefix_cache(on: bool, dask_worker=None) -> None:
    dask.config.set({"kvstate.vllm.read-prefix-cache": on})  # read by the vLLM backend at each request


@dataclass
class Setup:
    """A cluster with one backend installed, and how each variant runs on it.

    On the transformers backend the variants are :mod:`.workload`'s modes. On the vLLM
    backend they are what a vLLM user would run: ``replay`` is text replay on engines
    that do not read their prefix cache (vLLM with prefix caching off), ``prefix`` the
    same requests on engines that do (vLLM's own automatic prefix caching, one cache per
    worker, Dask placing the requests), and ``kvstate`` our states over those engines.
    """

    client: Client
    backend: str = "hf"

    def run(self, variant: str, context: str, k: int, new_tokens: int) -> dict:
        mode, batch = VARIANTS[variant]
        engine_cache: AbstractContextManager = contextlib.nullcontext()
        if self.backend == "vllm" and mode in ("replay", "prefix"):
            mode = "replay"  # the engine's own prefix cache, read or not, is the baseline here
            engine_cache = self._engine_prefix_cache(variant == "prefix")
        with engine_cache:
            return workload.run(self.client, mode, context, k, new_tokens, batch=batch)

    @contextlib.contextmanager
    def _engine_prefix_cache(self, read: bool):
        self.client.run(_read_engine_prefix_cache, read)
        try:
            yield
        finally:
            self.client.run(_read_engine_prefix_cache, True)


def _run(setup: Setup, variant, context, k, new_tokens, bar) -> dict:
    bar.set_postfix_str(f"{setup.backend} {variant} k={k}")
    r = setup.run(variant, context, k, new_tokens)
    bar.update()
    return {"variant": variant, "backend": setup.backend, **r}


def _identical(runs: list[dict]) -> bool:
    ids = [r["token_ids"] for r in runs]
    return all(x == ids[0] for x in ids)


def ttft_vs_context(setup: Setup, contexts: dict[int, str], agents: int, new_tokens: int, bar) -> list[dict]:
    """Experiment 1: per-agent TTFT (median over agents) vs context length, each mode.

    kvstate runs unbatched here: TTFT is a per-request latency, and a batch prefills
    its rows one after the other before decoding (experiment 2 shows what batching buys).
    """
    rows = []
    for L, ctx in contexts.items():
        runs = [_run(setup, v, ctx, agents, new_tokens, bar) for v in ("replay", "prefix", "kvstate-unbatched")]
        med = {r["variant"]: statistics.median(r["ttft_s"]) for r in runs}
        rows.append(
            {
                "backend": setup.backend,
                "L": L,
                "context_tokens": min(runs[0]["prompt_tokens"]),
                "agents": agents,
                "ttft_replay_s": med["replay"],
                "ttft_prefix_s": med["prefix"],
                "ttft_kvstate_s": med["kvstate-unbatched"],
                "speedup_vs_replay": med["replay"] / med["kvstate-unbatched"],
                "speedup_vs_prefix": med["prefix"] / med["kvstate-unbatched"],
                "fork_ms": fork_ms(setup.client, ctx),
                "identical": _identical(runs),
                "runs": runs,
            }
        )
        progress.write(
            f"exp1 {setup.backend} L={L}: TTFT replay {med['replay']:.3f} s, prefix {med['prefix']:.3f} s, kvstate "
            f"{med['kvstate-unbatched']:.3f} s -> {rows[-1]['speedup_vs_replay']:.1f}x / "
            f"{rows[-1]['speedup_vs_prefix']:.1f}x; fork {rows[-1]['fork_ms']:.3f} ms"
        )
    return rows


def backend_agreement(rows: list[dict], key: str) -> dict:
    """Whether the vLLM engines' text replay gives the tokens transformers' replay gives, agent
    by agent, for rows of both backends at the same ``key`` (``"L"`` or ``"k"``): the agents
    compared, those equal, and where each other one first diverges (greedy, same prompts)."""
    replay = {(r["backend"], r[key]): next(x for x in r["runs"] if x["variant"] == "replay") for r in rows}
    agents = equal = 0
    diverge = []
    for (backend, at), hf in replay.items():
        vllm = replay.get(("vllm", at)) if backend == "hf" else None
        for a, b in zip(hf["token_ids"], vllm["token_ids"] if vllm else []):
            agents += 1
            if a == b:
                equal += 1
            else:
                diverge.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {"agents": agents, "equal": equal, "first_divergence": diverge}


def _time_fork(ref, k: int, repeats: int, dask_worker=None) -> float:
    rt = dask_worker.plugins[WORKER_PLUGIN].runtime
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        rt.fork(ref, k)
        best = min(best, time.perf_counter() - t0)
    return best


def fork_ms(client, context: str, k: int = 16, repeats: int = 50) -> float:
    """Milliseconds for one ``fork(state, k)`` on the state's holder (best of ``repeats``)."""
    from dask_kvstate import tasks

    ref = client.submit(tasks.materialize, context, pure=False).result()
    holder = ref.placement.worker
    return client.run(_time_fork, ref, k, repeats, workers=[holder])[holder] * 1e3


def scaling(setup: Setup, context: str, ks, new_tokens: int, bar, variants=tuple(VARIANTS)) -> list[dict]:
    """Experiment 2 (and the runs experiments 4 and 5 read): k agents, aggregate wall time."""
    rows = []
    for k in ks:
        runs = [_run(setup, v, context, k, new_tokens, bar) for v in variants]
        by = {r["variant"]: r for r in runs}
        rows.append(
            {
                "backend": setup.backend,
                "k": k,
                "identical": _identical(runs),
                "runs": runs,
                **{f"wall_{v}_s": by[v]["wall_s"] for v in by},
                "speedup_vs_replay": by["replay"]["wall_s"] / by["kvstate"]["wall_s"],
                "speedup_vs_prefix": by["prefix"]["wall_s"] / by["kvstate"]["wall_s"],
            }
        )
        progress.write(
            f"exp2 {setup.backend} k={k}: "
            + ", ".join(f"{v} {by[v]['wall_s']:.2f} s" for v in by)
            + f" -> {rows[-1]['speedup_vs_replay']:.2f}x vs replay"
        )
    return rows


def memory(scaling_rows: list[dict], bytes_per_token: int) -> list[dict]:
    """Experiment 4 from experiment 2's runs: peak KV held at once, and KV computed, per branch factor."""
    rows = []
    for row in scaling_rows:
        by = {r["variant"]: r for r in row["runs"]}
        backend = row.get("backend", "hf")
        # A vLLM engine's paged KV is not in the worker's store, so its peak is not measured
        # here (None): only the KV computed compares across the backends.
        peaks = backend != "vllm"
        out = {"backend": backend, "branches": row["k"]}
        for v, r in by.items():
            out[f"peak_{v}_bytes"] = r["kv_peak_bytes"] if peaks else None
            out[f"computed_{v}_bytes"] = r["prefill_tokens"] * bytes_per_token
        for base in ("replay", "prefix"):
            out[f"peak_ratio_vs_{base}"] = (
                by[base]["kv_peak_bytes"] / max(by["kvstate"]["kv_peak_bytes"], 1) if peaks else None
            )
        out["computed_ratio_vs_replay"] = by["replay"]["prefill_tokens"] / max(by["kvstate"]["prefill_tokens"], 1)
        out["computed_ratio_vs_prefix"] = by["prefix"]["prefill_tokens"] / max(by["kvstate"]["prefill_tokens"], 1)
        rows.append(out)
    return rows


def memory_live(model: str, context_tokens: int, ks, new_tokens: int, workers: int, bar) -> list[dict]:
    """Experiment 4 with every branch in flight at once: peak KV held per branch factor, each mode.

    In experiment 2 each worker runs one task at a time, so text replay holds one
    agent's cache per worker while kvstate decodes its whole batch: their peaks are
    not comparable. Here each worker gets ``ceil(max(ks) / workers)`` threads, so all
    ``k`` agents of every mode are live together, as in a serving engine holding k
    requests. kvstate runs twice: with default placement (each worker that runs branches
    holds a copy of the state) and with ``placement.max-copies: 1`` (one copy; all branches
    on its holder, the second worker idle), the memory-for-time trade a user may choose.
    A cluster of its own (the thread count is the point), a context of
    ``context_tokens`` (the ratio barely depends on it; a shorter one keeps k
    concurrent text replays affordable on two cores).
    """
    from distributed import Client, LocalCluster

    import dask_kvstate as kvs

    threads = -(-max(ks) // workers)
    rows = []
    with (
        LocalCluster(n_workers=workers, threads_per_worker=threads, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        kvs.install(client, model, torch_threads=1)
        client.run(workload.warm_up)
        ctx = workload.contexts(client, [context_tokens])[context_tokens]
        for k in ks:
            runs = {}
            for mode in workload.MODES:
                bar.set_postfix_str(f"memory {mode} k={k}")
                runs[mode] = workload.run(client, mode, ctx, k, new_tokens)
                bar.update()
            # kvstate again with one copy of the state in the cluster (placement.max-copies,
            # read by the in-process scheduler): every branch on its holder.
            bar.set_postfix_str(f"memory kvstate, one copy, k={k}")
            with dask.config.set({"kvstate.placement.max-copies": 1}):
                runs["kvstate_one_copy"] = workload.run(client, "kvstate", ctx, k, new_tokens)
            bar.update()
            peak = {m: r["kv_peak_bytes"] for m, r in runs.items()}
            rows.append(
                {
                    "branches": k,
                    "context_tokens": min(runs["replay"]["prompt_tokens"]),
                    "threads": threads,
                    **{f"peak_{m}_bytes": b for m, b in peak.items()},
                    **{f"wall_{m}_s": r["wall_s"] for m, r in runs.items()},
                    "ratio_vs_replay": peak["replay"] / max(peak["kvstate"], 1),
                    "ratio_vs_prefix": peak["prefix"] / max(peak["kvstate"], 1),
                    "one_copy_ratio_vs_replay": peak["replay"] / max(peak["kvstate_one_copy"], 1),
                    "one_copy_ratio_vs_prefix": peak["prefix"] / max(peak["kvstate_one_copy"], 1),
                    "identical": _identical(list(runs.values())),
                }
            )
            r = rows[-1]
            progress.write(
                f"exp4 (all live) k={k}: peak replay {peak['replay'] / 2**20:.0f} MiB, prefix "
                f"{peak['prefix'] / 2**20:.0f} MiB, kvstate {peak['kvstate'] / 2**20:.0f} MiB -> "
                f"{r['ratio_vs_replay']:.1f}x / {r['ratio_vs_prefix']:.1f}x; one copy "
                f"{peak['kvstate_one_copy'] / 2**20:.0f} MiB -> {r['one_copy_ratio_vs_replay']:.1f}x / "
                f"{r['one_copy_ratio_vs_prefix']:.1f}x"
            )
    return rows


def throughput(scaling_rows: list[dict]) -> list[dict]:
    """Experiment 5 from the largest-k runs: tokens/s and Omega = busy time - (prefill + decode)."""
    row = max(scaling_rows, key=lambda r: r["k"])
    out = []
    for r in row["runs"]:
        busy = r["wall_s"] * r["workers"]  # every worker runs one task at a time
        # A vLLM engine steps a worker's concurrent requests together, so their prefill and
        # decode times overlap and Omega has no meaning there (None).
        omega = busy - r["model_s"] if r.get("backend", "hf") != "vllm" else None
        out.append(
            {
                "backend": r.get("backend", "hf"),
                "variant": r["variant"],
                "k": r["k"] if "k" in r else row["k"],
                "wall_s": r["wall_s"],
                "generated_tokens": r["generated_tokens"],
                "tokens_per_s": r["generated_tokens"] / r["wall_s"],
                "model_s": r["model_s"],
                "omega_s": omega,
                "omega_pct": None if omega is None else 100 * omega / busy,
            }
        )
    return out


def crossover_sweep(model: str, bandwidths, contexts, repeats: int, bar) -> list[dict]:
    """Experiment 3: the transfer-or-recompute sweep (:func:`dask_kvstate.bench.crossover.sweep_cell`)."""
    from distributed import Client, LocalCluster

    import dask_kvstate as kvs

    cells = []
    for bw in bandwidths:
        with (
            dask.config.set({"kvstate.transport.emulated-bandwidth": bw}),
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
            Client(cluster) as client,
        ):
            kvs.install(client, model, torch_threads=1)
            a, b = sorted(client.nthreads())
            for n in contexts:
                bar.set_postfix_str(f"crossover {bw} {n}")
                cell = crossover.sweep_cell(client, a, b, n, f"bench {bw} {n}", repeats)
                cells.append({"bandwidth": bw, **cell})
                bar.update()
    return cells
