"""Workflow shapes for the stateful compiler: plain ``kvs.generate`` calls, no state API.

Each builder returns the list of ``Delayed`` outputs of one multi-agent shape. The
compiler (``with kvs.stateflow():``) finds what they share; the tests and
``examples/compiler_shapes.py`` run each shape with it off and on.
"""

from __future__ import annotations

import dask

import dask_kvstate as kvs

SYSTEM = "You are one agent in a team. Read everything before you answer, and answer in one line.\n"
REPORT = (
    "The planner reads the task and writes a plan. The developer follows the plan and writes the code. "
    "The tester runs the tests and reports what failed, and the developer tries again. "
) * 3


def thought(i: int) -> str:
    """Branch ``i``'s own question in :func:`tree_of_thought`."""
    return f"Thought {i}: what should happen next?"


def tree_of_thought(k: int = 4, n: int = 12) -> list:
    return [kvs.generate(SYSTEM, REPORT, thought(i), max_new_tokens=n) for i in range(k)]


def debate(rounds: int = 3, agents: int = 2, n: int = 8) -> list:
    """Each round every agent reads the whole transcript so far (prompt = previous prompt + new turns)."""
    transcript: list = [SYSTEM, "Debate: is the tester or the planner more important?\n"]
    outs = []
    for r in range(rounds):
        turn = [kvs.generate(*transcript, f"Agent {a}, round {r + 1}:", max_new_tokens=n) for a in range(agents)]
        outs += turn
        for a, said in enumerate(turn):
            transcript = [*transcript, f"Agent {a}, round {r + 1}:", said, "\n"]
    return outs


@dask.delayed(pure=True)
def retrieve(query: str) -> str:
    """A stand-in retriever: an upstream task whose output (a document) several agents read."""
    return f"Document for {query!r}:\n" + REPORT


def rag(questions: int = 3, n: int = 12, retrieve_key: str | None = None) -> list:
    """``questions`` agents read one retrieved document. ``retrieve_key`` names the retriever's
    task, so workflows that run at once over the same query keep their own (the default key
    is the query's, shared by every such workflow)."""
    query = "who retries after a failure"
    doc = retrieve(query) if retrieve_key is None else retrieve(query, dask_key_name=retrieve_key)
    return [
        kvs.generate(SYSTEM, doc, f"Question {i}: who acts after the tests fail?", max_new_tokens=n)
        for i in range(questions)
    ]


def nested(n: int = 10) -> list:
    """system -> two documents -> two questions each: states at both levels."""
    docs = [REPORT, REPORT.replace("planner", "architect")]
    return [kvs.generate(SYSTEM, d, f"Q{j}: summarise.", max_new_tokens=n) for d in docs for j in range(2)]


def mid_word(n: int = 10) -> list:
    """The shared prefix ends inside a word: "The plan" + "ner ..." vs "The plan" + "ets ..."."""
    return [kvs.generate(SYSTEM, REPORT, "The plan", tail, max_new_tokens=n) for tail in ("ner speaks.", "ets align.")]


def unshared(n: int = 6) -> list:
    return [kvs.generate(f"Prompt number {i} shares nothing with the others.", max_new_tokens=n) for i in range(3)]


SHAPES = {"tree_of_thought": tree_of_thought, "debate": debate, "rag": rag, "nested": nested, "mid_word": mid_word}
