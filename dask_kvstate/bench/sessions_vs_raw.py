"""Many multi-round agent sessions at once, against the engine a user would run alone.

::

    python -m dask_kvstate.bench sessions-vs-raw --out docs/bench/sessions-vs-raw
    python -m dask_kvstate.bench sessions-vs-raw --sessions 8 --doc-tokens 300 --rounds 2   # shorter

``S`` sessions of the SWE-loop shape, each on its own ticket: round after round a
*planner*, a *developer* and a *tester* answer in turn on one growing shared context
(the ticket, then every earlier prompt and answer of the session), so each call's
prompt is the last one's plus a few dozen tokens. The sessions start together, all
running at once (``--rate`` spreads their arrivals open-loop, Poisson: at 0.5/s about six
of 32 overlap), and every call goes in the moment the session's previous answer is out.

Side by side, in one run, each row alone on the host (started, warmed up on a spare
session, measured, closed; repeats interleaved), every answer compared token for token
with the raw engine's:

- ``raw-vllm`` and ``raw-vllm-eager``: one ``vllm.LLM`` in its own process, every core,
  prefix caching on, fed as a server is (:meth:`RawEngine.sessions`): each call added to
  its step loop as it arrives, first come, first served; ``raw-vllm-core-in-process``
  with vLLM's engine core in that process, as a worker's engine runs;
- ``kvstate``: what a user of this library writes: a ``LocalCluster`` whose worker holds
  the vLLM engine, ``kvs.install`` with every default (workflow-progress priority
  included), each session a ``kvs.session`` of plain
  ``kvs.generate(context, prompt, prefix_cache=True)`` calls;
- ``kvstate-fcfs``: the same with ``scheduling=False``: what the scheduling gives.

Both sides get the same engine KV memory (``--engine-kv``). kvstate's store keeps what
its engine evicts in host memory beside it, so the raw rows run again with more engine
memory (``--raw-engine-kv``, named in the row: ``raw-vllm (3GiB KV)``): the raw engine
given that memory as its KV cache, which is what a user of vLLM on a CPU host can do
(vLLM's own KV offloading to host memory runs on GPUs only). Reported per row: mean,
P50 and P99 end-to-end session latency (arrival to last answer), the makespan, prompt
tokens the engine computed, the engine's steps and the seconds inside them (an engine
busy to the makespan is bounded by its own work), and the ratios to the raw engine's
(the best raw row per figure, whatever its memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from dask.utils import format_bytes, parse_bytes
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.bench import workload
from dask_kvstate.bench.raw_vllm import DEFAULT_RAW, RAW, RawEngine, cpu_model, raw_variant
from dask_kvstate.bench.sessions_report import markdown, report, summarize, write

#: ``kvs.install`` overrides of the kvstate rows.
KVSTATE = {"kvstate": {}, "kvstate-fcfs": {"scheduling": False}}
VARIANTS = (*RAW, *KVSTATE)
DEFAULT_VARIANTS = (*DEFAULT_RAW, *KVSTATE)
ROLES = (
    ("planner", "Planner: say in one sentence what the team should change next to close the ticket."),
    ("developer", "Developer: write the one-line code change for the planner's step."),
    ("tester", "Tester: name the test that checks the change and say whether it passes."),
)
#: what closes an answer's turn in the growing context (SmolLM2's chat format)
CLOSING = "<|im_end|>\n"


@dataclasses.dataclass
class Options:
    """The experiment's settings; ``python -m dask_kvstate.bench sessions-vs-raw`` has a flag for each."""

    model: str = dataclasses.field(default="smollm2-135m", metadata={"help": "model name or folder"})
    sessions: int = dataclasses.field(default=32, metadata={"help": "sessions, each on its own ticket"})
    doc_tokens: int = dataclasses.field(default=600, metadata={"help": "tokens of each session's ticket"})
    rounds: int = dataclasses.field(default=3, metadata={"help": "planner, developer, tester rounds per session"})
    new_tokens: int = dataclasses.field(default=16, metadata={"help": "tokens each call generates at most"})
    rate: float = dataclasses.field(
        default=0.0, metadata={"help": "sessions arriving per second (Poisson); 0: all at once"}
    )
    seed: int = dataclasses.field(default=0, metadata={"help": "the arrivals' seed"})
    engine_kv: str = dataclasses.field(
        default="1GiB", metadata={"help": "every engine's KV memory, raw and kvstate alike"}
    )
    raw_engine_kv: list[str] = dataclasses.field(
        # kvstate's store held at most 1 GiB beside its 1 GiB engine in the 32 sessions
        default_factory=lambda: ["3GiB"],
        metadata={
            "help": "raw rows run again with each of these engine KV memories (a raw engine given what "
            "kvstate's store holds beside its engine); the ratios are against the best raw row",
            "nargs": "*",
        },
    )
    max_model_len: int | None = dataclasses.field(
        default=None, metadata={"help": "the engines' longest request (tokens); default: the model's own"}
    )
    threads: int = dataclasses.field(
        default=16, metadata={"help": "kvstate: the worker's threads, the calls its engine runs at once"}
    )
    raw_max_seqs: int | None = dataclasses.field(
        default=None, metadata={"help": "raw rows: requests the engine runs at once (max_num_seqs); default: vLLM's"}
    )
    variants: list[str] = dataclasses.field(
        default_factory=lambda: list(DEFAULT_VARIANTS),
        metadata={"help": "rows to run", "nargs": "+", "choices": VARIANTS},
    )
    repeats: int = dataclasses.field(default=2, metadata={"help": "interleaved repeats; the table shows medians"})
    out: str | None = dataclasses.field(default=None, metadata={"help": "folder for sessions_vs_raw.{md,json,png}"})


def small(**settings) -> Options:
    """The experiment at a size the test and the asv suite can afford: four sessions of two
    rounds on ~300-token tickets, all arriving at once, in an engine holding about two
    thirds of what they grow to (SmolLM2-135M: 45 KiB of KV a token)."""
    defaults = {"sessions": 4, "doc_tokens": 300, "rounds": 2, "new_tokens": 8, "rate": 0.0, "repeats": 1}
    return Options(**{**defaults, "engine_kv": "64MiB", "raw_engine_kv": [], "max_model_len": 1024, **settings})


# -- the workload ---------------------------------------------------------------------
def ticket(s: int, lines: int) -> str:
    """Session ``s``'s ticket: its own header first, so no two sessions share a block."""
    body = "".join(workload.log_line(i + 6151 * s) for i in range(lines))
    return (
        f"<|im_start|>system\nSession {s}. You are one agent of a software team fixing a ticket. "
        f"Answer briefly.<|im_end|>\n<|im_start|>user\nTicket BUG-{4200 + s}: checkout times out under load. "
        f"Failing log:\n{body}{CLOSING}"
    )


def prompts(rounds: int) -> list[str]:
    """The calls of a session, in order: planner, developer, tester, round after round."""
    return [
        f"<|im_start|>user\nRound {r + 1}. {text}{CLOSING}<|im_start|>assistant\n"
        for r in range(rounds)
        for _, text in ROLES
    ]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each session arrives: Poisson at ``rate``, the first at 0.

    >>> arrivals(3, 0.0, 0)
    [0.0, 0.0, 0.0]
    >>> a = arrivals(4, 2.0, 1); a[0], a == sorted(a), a == arrivals(4, 2.0, 1)
    (0.0, True, True)
    """
    if rate <= 0:
        return [0.0] * n
    gaps = np.random.default_rng([seed, 36]).exponential(1 / rate, n)
    return [0.0, *np.cumsum(gaps[1:]).round(3).tolist()]


def sessions_of(args: Options, first: int = 0) -> list[dict]:
    """The sessions every row runs: ``{"arrival", "context", "prompts"}`` each."""
    tokenize = workload.tokenizer_of(args.model)
    calls = prompts(args.rounds)
    times = arrivals(args.sessions, args.rate, args.seed)
    return [
        {
            "arrival": t,
            "context": ticket(s, workload.fit(lambda n, s=s: ticket(s, n), args.doc_tokens, tokenize)),
            "prompts": calls,
        }
        for s, t in zip(range(first, first + args.sessions), times)
    ]


# -- the rows -------------------------------------------------------------------------
def run_kvstate(client: Client, sessions: list[dict], new_tokens: int) -> tuple[list[dict], dict]:
    """The sessions as a user writes them: a ``kvs.session`` each, plain ``kvs.generate``
    calls with the prefix cache, each computed as its prompt is known; from empty stores
    and engine caches. A thread per session stands for the users. Back: one dict per
    session, and the workers' engine steps over the run (:func:`engine_steps`)."""
    workload.settle(client)
    before = engine_steps(client)
    t0 = time.perf_counter()

    def session(i: int) -> dict:
        s = sessions[i]
        time.sleep(max(0.0, s["arrival"] - (time.perf_counter() - t0)))
        context, calls = s["context"], []
        with kvs.session(f"swe-{i}", client=client):
            for prompt in s["prompts"]:
                t = time.perf_counter()
                g = kvs.generate(context, prompt, max_new_tokens=new_tokens, prefix_cache=True).compute()
                calls.append(
                    {
                        "token_ids": list(g.token_ids),
                        "latency_s": time.perf_counter() - t,
                        "computed_tokens": g.prefill_tokens,
                    }
                )
                context += prompt + g + CLOSING
        return {"calls": calls, "arrival_s": s["arrival"], "end_s": time.perf_counter() - t0}

    with ThreadPoolExecutor(len(sessions), thread_name_prefix="session") as pool:
        result = list(pool.map(session, range(len(sessions))))
    after = engine_steps(client)
    return result, {k: after[k] - before[k] for k in after}


def engine_steps(client: Client) -> dict[str, float]:
    """Steps the workers' engines ran so far, the seconds inside them, and of those the
    seconds copying KV into the engine and out of it (``load_s``, ``capture_s``; ``kvs.stats``).

    Beside the raw engine's own count, this says where a row's time went: an engine busy
    through the whole run is bounded by its work (the tokens it computes and the steps it
    takes for them), a row whose engine idles by what it waits on outside the steps.
    """
    engines = [w.get("engine", {}) for w in kvs.stats(client).workers.values()]
    return {k: sum(float(e.get(k, 0)) for e in engines) for k in ("steps", "step_s", "load_s", "capture_s")}


def run_raw(engine: RawEngine, sessions: list[dict], new_tokens: int) -> tuple[list[dict], dict]:
    engine.reset_prefix_cache()
    return engine.sessions(sessions, new_tokens, CLOSING)


def rows(args: Options) -> dict[str, tuple[str, str]]:
    """The rows, in the order every repeat runs them: name -> (variant, engine KV memory).

    A raw variant runs with ``args.engine_kv`` under its own name and once more per size of
    ``args.raw_engine_kv``, named with it:

    >>> list(rows(Options(variants=["raw-vllm", "kvstate"], raw_engine_kv=["3GiB"])).items())
    [('raw-vllm', ('raw-vllm', '1GiB')), ('raw-vllm (3GiB KV)', ('raw-vllm', '3GiB')), ('kvstate', ('kvstate', '1GiB'))]
    """
    more = [kv for kv in dict.fromkeys(args.raw_engine_kv) if kv != args.engine_kv]  # each size once
    out: dict[str, tuple[str, str]] = {}
    for v in VARIANTS:
        if v in args.variants:
            out[v] = (v, args.engine_kv)
            if v in RAW:
                out.update({f"{v} ({kv} KV)": (v, kv) for kv in more})
    return out


@contextlib.contextmanager
def started(name: str, args: Options, spare: list[dict]) -> Iterator[Callable[[list[dict]], tuple[list[dict], dict]]]:
    """Row ``name`` started alone on the host and warmed up on the ``spare`` sessions
    (untimed): how to run the sessions on it; closed on leaving, before the next row
    starts (rows resident side by side slow each other, ``agents_vs_raw.started``)."""
    variant, engine_kv = rows(args)[name]
    kv = parse_bytes(engine_kv)
    if variant in RAW:
        with RawEngine(
            args.model,
            kv_cache_bytes=kv,
            max_model_len=args.max_model_len,
            **RAW[variant],
            max_num_seqs=args.raw_max_seqs,
        ) as e:
            print(f"  {name}: engine started in {e.start_s:.1f} s", flush=True)
            run_raw(e, spare, args.new_tokens)
            yield lambda sessions: run_raw(e, sessions, args.new_tokens)
        return
    settings = {"kvstate.vllm.kv-cache-bytes": kv, "kvstate.vllm.max-model-len": args.max_model_len}
    cluster = LocalCluster(n_workers=1, threads_per_worker=args.threads, dashboard_address=":0")
    try:
        with Client(cluster) as client:
            workload.install(client, args.model, settings, backend="vllm", **KVSTATE[variant])
            client.run(workload.warm_up)
            with client.as_current():
                run_kvstate(client, spare, args.new_tokens)
                yield lambda sessions: run_kvstate(client, sessions, args.new_tokens)
    finally:
        cluster.close()


def command(args: Options) -> dict:
    """Every row ``args.repeats`` times, interleaved, each alone; the report to ``args.out``."""
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    for flag, size in [("--engine-kv", args.engine_kv)] + [("--raw-engine-kv", kv) for kv in args.raw_engine_kv]:
        try:
            parse_bytes(size)
        except (ValueError, TypeError):
            raise ValueError(f"{flag} {size!r} is not a memory size (write it as 1GiB, 512MiB, ...)") from None
    _, refused = workload.runnable({n: None if raw_variant(n) else "vllm" for n in rows(args)}, args.model)
    if refused:  # every kvstate row runs over vLLM, so none can: say so before any engine starts
        from dask_kvstate.backends.layout import UnsupportedModel

        raise UnsupportedModel(f"sessions-vs-raw runs kvstate over vLLM: {next(iter(refused.values()))}")
    sessions = sessions_of(args)
    # Warm-up: two sessions of one round on tickets no measured session has, so nothing of
    # them is reused (a first round runs every kind of call a row makes).
    spare = sessions_of(dataclasses.replace(args, sessions=2, rounds=1, rate=0.0), first=args.sessions)
    print(
        f"sessions-vs-raw: {args.sessions} sessions x {args.rounds} rounds x {len(ROLES)} roles, tickets of "
        f"<= {args.doc_tokens} tokens, arrivals {args.rate}/s, engine KV {format_bytes(parse_bytes(args.engine_kv))}",
        flush=True,
    )
    runs: dict[str, list[list[dict]]] = {}
    steps: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for name in rows(args):
            with started(name, args, spare) as run:
                result, engine = run(sessions)
            runs.setdefault(name, []).append(result)
            steps.setdefault(name, []).append(engine)
            print(f"  repeat {rep}: {name} {summarize(result, engine)}", flush=True)
    res = report(runs, args, steps)
    res["cpu"] = cpu_model()
    if args.out:
        write(res, Path(args.out))
    print(markdown(res))
    return res
