"""The chaos soak's workflows: tree of thought, debate, RAG and the SWE loop, each run two ways.

Every workflow runs either *stateful* (what the soak checks: explicit states for tree of
thought and the SWE loop, the compiler for debate and RAG, one ``kvs.session`` and one
namespace per workflow) or as *text replay* (plain ``kvs.generate`` on the same prompts,
no state, no session: the reference). Both return the generated token ids, one list per
LLM call, in the same order, so the soak compares them with ``==``.

A workflow is one request of an asynchronous client, so many run at once from one
event loop. Dask's annotations and config are process-wide, not per coroutine, so
every graph is built and submitted inside one synchronous block (:meth:`Run.submit`)
and awaited outside it: no other workflow's session or namespace can leak into it.
Each workflow has its own namespace, which is in every key, so two workflows with
the same prompts are separate tasks (and separate blocks), while their outputs, and
so their reference, are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import dask
from distributed import Client

import dask_kvstate as kvs
from dask_kvstate.bench.kv_lifecycle import conversation, run_tests
from dask_kvstate.protocol import SESSION_ANNOTATION, SESSION_TOPIC
from dask_kvstate.session import new_session_id
from dask_kvstate.testing import shapes

#: New tokens per LLM call: enough to compare, few enough for hundreds of workflows on two cores.
NEW_TOKENS = 6

#: Per kind, the parameter sets a workflow draws from (each a distinct reference).
VARIANTS: dict[str, list[dict]] = {
    "tree_of_thought": [{"k": 2}, {"k": 3}],
    "debate": [{"rounds": 1}, {"rounds": 2}],
    "rag": [{"questions": 2}, {"questions": 3}],
    "swe": [{"ticket": 0, "rounds": 2}, {"ticket": 1, "rounds": 2}, {"ticket": 2, "rounds": 3}],
}


@dataclass(frozen=True)
class Spec:
    """One workflow of the mix: its kind, its parameters and its place in the run."""

    index: int
    kind: str
    variant: int
    tool_seconds: float = 0.0  # the SWE loop's test runs

    @property
    def params(self) -> dict:
        return VARIANTS[self.kind][self.variant]

    @property
    def reference_key(self) -> tuple[str, int]:
        """Workflows with equal keys have equal outputs: the text replay is run once per key."""
        return (self.kind, self.variant)


def mix(n: int, seed: int = 0, tool_seconds: float = 0.3) -> list[Spec]:
    """``n`` workflows, the kinds in turn, parameters and tool durations drawn from ``seed``.

    Examples
    --------
    >>> [s.kind for s in mix(5)]
    ['tree_of_thought', 'debate', 'rag', 'swe', 'tree_of_thought']
    >>> mix(8, seed=1) == mix(8, seed=1)
    True
    """
    rng = random.Random(seed)
    kinds = list(VARIANTS)
    specs = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        seconds = tool_seconds * rng.lognormvariate(0.0, 0.4) if kind == "swe" else 0.0
        specs.append(Spec(i, kind, rng.randrange(len(VARIANTS[kind])), round(seconds, 3)))
    return specs


class Run:
    """What one workflow submits with: its client, session, namespace and mode."""

    def __init__(self, client: Client, spec: Spec, stateful: bool, deadline: float):
        self.client = client
        self.spec = spec
        self.stateful = stateful
        self.deadline = deadline  # time.monotonic() by which every result must be in
        self.session = new_session_id(f"soak-{spec.kind}-{spec.index}") if stateful else None
        self.namespace = f"soak-{spec.index}" if stateful else "soak-reference"

    def submit(self, build: Callable[..., list], *args, compiled: bool = False) -> list:
        """Build and submit ``build(*args)``'s outputs under this workflow's session and namespace."""
        annotations = {SESSION_ANNOTATION: self.session} if self.session else {}
        flow = kvs.stateflow() if compiled and self.stateful else contextlib.nullcontext()
        with dask.config.set({"kvstate.namespace": self.namespace}), dask.annotate(**annotations), flow:
            return self.client.compute(build(*args))

    async def results(self, build: Callable[..., list], *args, compiled: bool = False) -> list:
        """The outputs of ``build(*args)``; ``asyncio.TimeoutError`` past the deadline."""
        futures = self.submit(build, *args, compiled=compiled)
        try:
            return await asyncio.wait_for(self.client.gather(futures), max(self.deadline - time.monotonic(), 0.1))
        finally:
            for f in futures:  # the invocation is over: only the values live on
                f.release()

    async def close(self) -> None:
        """Tell the scheduler this workflow's session is over (what ``kvs.session``'s exit sends)."""
        if self.session is not None:
            msg = {"kind": "close", "session": self.session, "client": self.client.id}
            await self.client.log_event(SESSION_TOPIC, msg)


def _tokens(outs) -> list[list[int]]:
    return [list(o.token_ids) for o in outs]


async def tree_of_thought(run: Run, k: int) -> list[list[int]]:
    """One report, ``k`` thoughts: materialize, fork, resume (replay: ``shapes.tree_of_thought``)."""

    def build() -> list:
        if not run.stateful:
            return shapes.tree_of_thought(k, NEW_TOKENS)
        state = kvs.materialize(shapes.SYSTEM, shapes.REPORT)
        return [kvs.resume(s, shapes.thought(i), max_new_tokens=NEW_TOKENS) for i, s in enumerate(kvs.fork(state, k))]

    return _tokens(await run.results(build))


async def debate(run: Run, rounds: int) -> list[list[int]]:
    """Two agents, each round reading the whole transcript: the compiler makes it a chain of extends."""
    return _tokens(await run.results(shapes.debate, rounds, 2, NEW_TOKENS, compiled=True))


async def rag(run: Run, questions: int) -> list[list[int]]:
    """A retriever's document read by ``questions`` agents, through the compiler."""
    key = f"retrieve-{run.namespace}"
    return _tokens(await run.results(shapes.rag, questions, NEW_TOKENS, key, compiled=True))


def _report(ticket: int, r: int) -> str:
    return f" Round {r}: test_{ticket}_{r} failed, the last field of record {r + 1} is missing."


def _replay_turn(text: str, report: str) -> list:
    return [kvs.generate(text, report, max_new_tokens=NEW_TOKENS)]


def _turn(run: Run, ref, r: int, report: str) -> list:
    """One round: the test run (a tool task), the answer from the conversation, the conversation extended."""
    with kvs.component("tester"):
        tool = dask.delayed(run_tests)(run.spec.tool_seconds, report, dask_key_name=f"run_tests-{run.session}-{r}")
    answer = kvs.resume(ref, tool, max_new_tokens=NEW_TOKENS)
    return [answer, kvs.extend(ref, tool, answer)]


async def swe(run: Run, ticket: int, rounds: int) -> list[list[int]]:
    """The developer loop: run the tests (a tool, no KV), answer from the conversation, extend it.

    Every round is its own invocation: only the new state's ref (a value) crosses to the
    next, as an agent loop keeps it between turns, so between rounds only the session
    holds the KV. Replay carries the text instead and prefills all of it every round.
    """
    outs: list[list[int]] = []
    if not run.stateful:
        text = conversation(ticket)
        for r in range(rounds):
            (answer,) = await run.results(_replay_turn, text, _report(ticket, r))
            outs.append(list(answer.token_ids))
            text = text + _report(ticket, r) + answer
        return outs
    (ref,) = await run.results(lambda: [kvs.materialize(conversation(ticket))])
    for r in range(rounds):
        answer, ref = await run.results(_turn, run, ref, r, _report(ticket, r))
        outs.append(list(answer.token_ids))
    return outs


#: kind -> the coroutine that runs one workflow of it
KINDS: dict[str, Callable[..., Awaitable[list[list[int]]]]] = {
    "tree_of_thought": tree_of_thought,
    "debate": debate,
    "rag": rag,
    "swe": swe,
}


async def run_workflow(client: Client, spec: Spec, stateful: bool, deadline: float) -> list[list[int]]:
    """Run ``spec`` to the end (its session closed, whatever happened); its token ids per LLM call."""
    run = Run(client, spec, stateful, deadline)
    try:
        return await KINDS[spec.kind](run, **spec.params)
    finally:
        await run.close()
