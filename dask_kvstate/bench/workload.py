"""The benchmark workload: prompts, the three baselines, and one measured run of them.

One *run* is ``k`` agents that share an ``L``-token context, each with its own suffix
(~32 tokens), each generating ``Y`` tokens, computed on the cluster in one of three
modes, all from the same ``kvs.generate`` code:

* ``replay``: plain ``dask.delayed`` text replay, every agent prefills the whole prompt;
* ``prefix``: the same calls with ``prefix_cache=True``: each worker reuses blocks it
  already holds (per-worker automatic prefix caching), Dask's default scheduling;
* ``kvstate``: the same calls under ``kvs.stateflow()``: compiler, block stores,
  placement, batched siblings (``kvstate.compiler.batch-siblings``).

Between runs every worker's store, and a vLLM engine's own prefix cache, is emptied, so no mode
profits from another's blocks.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import dask

import dask_kvstate as kvs
from dask_kvstate.generation import Sampling
from dask_kvstate.protocol import WORKER_PLUGIN

MODES = ("replay", "prefix", "kvstate")

SYSTEM = "You are one agent of a team reviewing an incident. Read the report and answer briefly."
QUESTIONS = [
    "What is the most likely root cause?",
    "Which single metric would have caught this earliest?",
    "Propose one immediate mitigation the on-call engineer can apply now.",
    "Write a one-line title for the postmortem.",
    "Which team should own the follow-up action?",
    "Was the pod restart a good idea?",
    "What should the alert threshold be for pool wait time?",
    "Name one test that would have prevented this change from shipping.",
]


def log_line(i: int) -> str:
    worker, wait = i % 7, (i * 37) % 900 + 12
    status = "TIMEOUT" if i % 9 == 4 else "ok"
    return f"09:{12 + i // 60 % 48:02d}:{i % 60:02d} checkout-{worker} pool_wait={wait}ms orders_query {status}\n"


def context_text(lines: int) -> str:
    body = "".join(log_line(i) for i in range(lines))
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nIncident report INC-2291, log lines:\n{body}"


def suffix(i: int) -> str:
    """Agent ``i``'s own part of the prompt (about 32 tokens)."""
    q = QUESTIONS[i % len(QUESTIONS)]
    return (
        f"\nYou are agent {i} of the review team. {q} Answer in one short sentence.<|im_end|>\n<|im_start|>assistant\n"
    )


def fit(text_of, tokens: int, tokenize) -> int:
    """Most lines ``n`` whose ``text_of(n)`` stays within ``tokens`` tokens under ``tokenize``."""
    lo, hi = 0, 1
    while len(tokenize(text_of(hi))) <= tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(tokenize(text_of(mid))) <= tokens else (lo, mid)
    return lo


def _fit_lines(tokens: int, dask_worker=None) -> int:
    """Most log lines whose context stays within ``tokens`` tokens (run on a worker: it has the tokenizer)."""
    return fit(context_text, tokens, dask_worker.plugins[WORKER_PLUGIN].runtime.backend.tokenize)


def tokenizer_of(model: str):
    """``text -> token ids`` with ``model``'s own tokenizer, in this process (the rule the backends tokenize by)."""
    from transformers import AutoTokenizer

    from dask_kvstate.backends import models

    tok = AutoTokenizer.from_pretrained(models.folder(model))
    return lambda text: tok(text)["input_ids"]


def runnable(rows: dict[str, str | None], model: str) -> tuple[list[str], dict[str, str]]:
    """The rows (name -> the kvstate backend it runs, None for a raw engine) that can run
    ``model``, in order, and the others with why their backend refuses it: an experiment
    runs the first and reports the second, so a model one backend cannot serve (on vLLM,
    one whose every layer slides) still gets its other rows measured. vLLM alone serves
    what it serves: a raw row is never left out here."""
    from dask_kvstate.backends import check_supported
    from dask_kvstate.backends.layout import UnsupportedModel

    refused: dict[str, str] = {}
    for backend in dict.fromkeys(b for b in rows.values() if b is not None):
        try:
            check_supported(model, backend)
        except UnsupportedModel as e:
            refused[backend] = str(e)
    kept = [row for row, b in rows.items() if b not in refused]
    return kept, {row: refused[b] for row, b in rows.items() if b in refused}


def left_out_lines(why: dict[str, str]) -> list[str]:
    """Markdown lines saying which rows were left out and why (none: no lines)."""
    if not why:
        return []
    return ["", "Left out, their backend refusing the model:", "", *(f"- {row}: {w}" for row, w in why.items())]


def contexts(client, lengths) -> dict[int, str]:
    """A context of at most ``L`` tokens for every ``L``, measured with the cluster's tokenizer."""
    w = sorted(client.nthreads())[0]
    return {L: context_text(client.run(_fit_lines, L, workers=[w])[w]) for L in lengths}


# -- worker-side helpers -------------------------------------------------------------
def _reset(dask_worker) -> None:
    """Empty the store (unheld blocks) and an engine's own prefix cache, and start the peak counters afresh."""
    plugin = dask_worker.plugins[WORKER_PLUGIN]
    for rt in plugin.runtimes.values():
        rt.backend.reset_engine_cache()  # a vLLM engine's, say
        rt.store.discard(list(rt.store))
        rt.store.device_peak = rt.store.device.total_weight
        rt.counters["kv_peak_bytes"] = rt.store.device.total_weight
    if getattr(plugin, "placement", False):
        plugin.report_to_placement()  # now, not at the next report tick: placement must not count the dropped blocks


def settle(client, timeout: float = 60.0) -> None:
    """Wait until the scheduler has forgotten the last run's tasks, then reset the workers.

    The last run's keys are released asynchronously after its results are gathered
    (scheduler first, then each worker); until a worker has dropped them, the tasks' pins
    keep their blocks in its store, and a
    reset then would leave them there: counted in the next run's peak KV, and free hits
    for its prefill.
    """
    deadline = time.monotonic() + timeout

    def busy() -> bool:
        if client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)):
            return True
        return any(client.run(lambda dask_worker: len(dask_worker.state.tasks)).values())

    while busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    client.run(_reset)


def install(client, model: str, settings: dict[str, Any], **kwargs) -> dict:
    """``kvs.install(client, model, **kwargs)`` with ``settings`` (``kvstate.*`` keys) in force,
    each checked on every worker.

    The client's ``kvstate`` config travels with the worker plugin, and the workers' engines
    start under it, not under the config their processes were started with: a setting
    meant for a row's engines (its KV memory, its longest request) set only around the
    cluster's start is silently replaced by the client's. So it is set around the install,
    and a row whose workers hold another value fails here rather than report figures
    measured under an engine it does not name.
    """
    with dask.config.set(settings):
        installed = kvs.install(client, model, **kwargs)
    for worker, got in installed.items():
        for key, want in settings.items():
            have = dask.config.get(key, None, config=got["config"])
            if have != want:
                raise RuntimeError(f"{worker} installed {key} = {have!r}, the row asked for {want!r}")
    return installed


def warm_up(dask_worker) -> None:
    """Run with ``client.run``: a first generate pays kernel and allocator setup, so no measured run does."""
    dask_worker.plugins[WORKER_PLUGIN].runtime.backend.generate([1, 2, 3], None, Sampling(2))


def kv_bytes_per_token(client) -> int:
    return next(
        iter(
            client.run(
                lambda dask_worker: dask_worker.plugins[WORKER_PLUGIN].runtime.backend.kv_bytes_per_token
            ).values()
        )
    )


def prefill_tokens(client) -> int:
    """Prompt tokens the workers' models computed so far (materializes and resumes alike;
    not those a state or an engine's own prefix cache served): ``kvs.stats``' counter."""
    return int(kvs.stats(client).workers.totals.get("prefill_tokens", 0))


def _counters(client) -> dict:
    return {w: dict(s) for w, s in kvs.stats(client).workers.items()}


def build(mode: str, context: str, k: int, new_tokens: int) -> list:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    extra: dict[str, Any] = {"prefix_cache": True} if mode == "prefix" else {}
    return [kvs.generate(context, suffix(i), max_new_tokens=new_tokens, **extra) for i in range(k)]


def run(client, mode: str, context: str, k: int, new_tokens: int, *, batch: int | None = None) -> dict:
    """One measured run: ``k`` agents in ``mode``; returns wall time, per-agent results and counters.

    ``batch``: most siblings per batched resume (kvstate only); default: the agents
    split evenly over the workers, so every worker decodes one batch.
    """
    settle(client)
    n_workers = len(client.nthreads())
    batch = batch or max(1, -(-k // n_workers))
    outs = build(mode, context, k, new_tokens)
    before = _counters(client)
    compiled = kvs.stateflow() if mode == "kvstate" else contextlib.nullcontext()
    with compiled, dask.config.set({"kvstate.compiler.batch-siblings": batch}):
        t0 = time.perf_counter()
        futures = client.compute(outs)
        results = client.gather(futures)
        wall = time.perf_counter() - t0
    after = _counters(client)
    del futures
    delta = {
        c: sum(after[w].get(c, 0) - before.get(w, {}).get(c, 0) for w in after)
        for c in ("prefill_tokens", "reused_tokens", "transfer_bytes", "transfers", "resume_batches")
    }
    # Model time: prefill per agent, decode once per batch (rows of a batch share its steps).
    decode = {}
    for g in results:
        decode[getattr(g, "batch_id", id(g))] = g.decode_s
    model_s = sum(g.prefill_s for g in results) + sum(decode.values())
    return {
        "mode": mode,
        "agents": k,
        "new_tokens": new_tokens,
        "wall_s": wall,
        "batch": batch if mode == "kvstate" else 1,
        "ttft_s": [g.ttft for g in results],
        "prompt_tokens": [g.prompt_tokens for g in results],
        "token_ids": [list(g.token_ids) for g in results],
        "generated_tokens": sum(len(g.token_ids) for g in results),
        "prefill_s": sum(g.prefill_s for g in results),
        "decode_s": sum(decode.values()),
        "model_s": model_s,
        "kv_peak_bytes": sum(after[w].get("kv_peak_bytes", 0) for w in after),
        "kv_peak_bytes_max_worker": max(after[w].get("kv_peak_bytes", 0) for w in after),
        "workers": n_workers,
        **delta,
    }
