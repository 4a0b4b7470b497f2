"""The raw vLLM engine's own process: started by :class:`~dask_kvstate.bench.raw_vllm.RawEngine`
with ``spawn``, it starts ``vllm.LLM`` and answers the parent's requests over a pipe.

The ways a user hands requests to the engine live here, run in the engine's process as a
user's own code would: one ``LLM.generate`` call, one request at a time through the
engine's step loop, and sessions whose calls are added to that loop as they arrive.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from dask_kvstate.bench.raw_vllm import RawResult, RawSettings


def serve(conn, settings: dict[str, Any]) -> None:
    """The engine's process: start ``vllm.LLM``, then answer the parent's requests until told to close.

    It leads a process group of its own, so the processes vLLM starts (its engine core and
    model executor) go with it when the parent has to kill it.
    """
    os.setpgrp()
    try:
        llm, start_s = _start(RawSettings(**settings))
    except BaseException:
        conn.send({"error": traceback.format_exc()})
        return
    conn.send({"start_s": start_s})
    ops: dict[str, Callable[..., dict]] = {
        "generate": _generate,
        "one_by_one": _one_by_one,
        "sessions": _sessions,
        "reset": lambda llm: {"reset": llm.reset_prefix_cache()},
    }
    try:
        while True:
            try:
                op, kwargs = conn.recv()
            except EOFError:  # the parent is gone
                return
            if op == "close":
                return
            try:
                conn.send(ops[op](llm, **kwargs))
            except BaseException:
                conn.send({"error": traceback.format_exc()})
    finally:
        llm.llm_engine.engine_core.shutdown()  # vLLM's engine core process would outlive this one


def _start(settings: RawSettings):
    # Read by vLLM when the engine starts: the cores, and no GiB-rounded KV size overriding ours.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.cores
    if settings.kv_cache_bytes is not None:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if settings.core_in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    kwargs: dict[str, Any] = {"model": settings.folder, "dtype": settings.dtype, "enable_prefix_caching": True}
    kwargs["seed"] = 0
    kwargs["enforce_eager"] = settings.enforce_eager
    for name, value in (
        ("kv_cache_memory_bytes", settings.kv_cache_bytes),
        ("block_size", settings.block_tokens),
        ("max_model_len", settings.max_model_len),
        ("max_num_seqs", settings.max_num_seqs),
    ):
        if value is not None:
            kwargs[name] = value
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    return llm, time.perf_counter() - t0


def _greedy(max_new_tokens: int, **kwargs):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max(1, max_new_tokens), temperature=0.0, **kwargs)


def _prompt_tokens(out) -> dict[str, int]:
    """A finished request's prompt tokens its prefix cache served, and all its prompt tokens."""
    return {"cached_tokens": int(out.num_cached_tokens or 0), "prompt_tokens": len(out.prompt_token_ids or [])}


def _generate(llm, prompts: list[str], max_new_tokens: int) -> dict:
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, _greedy(max_new_tokens), use_tqdm=False)
    wall = time.perf_counter() - t0
    results = [asdict(RawResult(list(o.outputs[0].token_ids), wall, wall, **_prompt_tokens(o))) for o in outputs]
    return {"results": results, "wall_s": wall}


def _one_by_one(llm, prompts: list[str], max_new_tokens: int) -> dict:
    """The engine's own step loop (what ``LLM.generate`` runs), one request at a time, noting its first token."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = _greedy(max_new_tokens, output_kind=RequestOutputKind.CUMULATIVE)
    results = []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"raw-{i}-{time.monotonic_ns()}", prompt, params)
        first = None
        done = None
        while done is None:
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                if out.finished:
                    done = out
        latency = time.perf_counter() - t0
        results.append(
            asdict(RawResult(list(done.outputs[0].token_ids), first or latency, latency, **_prompt_tokens(done)))
        )
    return {"results": results}


def _sessions(llm, sessions: list[dict], max_new_tokens: int, closing: str) -> dict:
    """The engine's own step loop fed as a server is: each call added when it arrives.

    A session's first call arrives at its arrival time, every later one the moment the
    previous answer is out; vLLM's scheduler runs them first come, first served, its
    prefix cache serving what a call shares with the session's earlier ones.
    """
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    # The answer's text as the tokenizer decodes its ids: the rule the kvstate rows use
    # too (``Generation`` text), so both sides grow the very same contexts.
    tokenizer = llm.get_tokenizer()
    params = _greedy(max_new_tokens, output_kind=RequestOutputKind.FINAL_ONLY)
    state = [{"context": s["context"], "calls": [], "arrival_s": s["arrival"], "end_s": None} for s in sessions]
    arrivals = sorted(range(len(sessions)), key=lambda i: sessions[i]["arrival"])
    inflight: dict[str, tuple[int, float]] = {}
    t0 = time.perf_counter()

    def submit(i: int) -> None:
        n = len(state[i]["calls"])
        request_id = f"s{i}-c{n}-{time.monotonic_ns()}"
        inflight[request_id] = (i, time.perf_counter())
        engine.add_request(request_id, state[i]["context"] + sessions[i]["prompts"][n], params)

    left, steps, step_s = len(sessions), 0, 0.0
    while left:
        now = time.perf_counter() - t0
        while arrivals and sessions[arrivals[0]]["arrival"] <= now:
            submit(arrivals.pop(0))
        if not inflight:
            time.sleep(max(0.0, sessions[arrivals[0]]["arrival"] - now))
            continue
        t_step = time.perf_counter()
        outputs = engine.step()
        steps, step_s = steps + 1, step_s + time.perf_counter() - t_step
        for out in outputs:
            if not out.finished:
                continue
            i, submitted = inflight.pop(out.request_id)
            st, prompts = state[i], sessions[i]["prompts"]
            ids = list(out.outputs[0].token_ids)
            prompt = prompts[len(st["calls"])]
            cached = int(out.num_cached_tokens or 0)
            st["calls"].append(
                {
                    "token_ids": ids,
                    "latency_s": time.perf_counter() - submitted,
                    "cached_tokens": cached,
                    "computed_tokens": len(out.prompt_token_ids or []) - cached,
                }
            )
            st["context"] += prompt + tokenizer.decode(ids, skip_special_tokens=True) + closing
            if len(st["calls"]) < len(prompts):
                submit(i)
            else:
                st["end_s"] = time.perf_counter() - t0
                left -= 1
    return {
        "sessions": [{k: v for k, v in st.items() if k != "context"} for st in state],
        "engine": {"steps": steps, "step_s": step_s},
    }
