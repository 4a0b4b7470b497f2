"""Analysis: find LLM calls in a task graph and plan the KV-state tasks that serve them.

A call's prompt is its list of segments. Two calls share a prefix when their leading
segments are the same: equal literal strings, or the same upstream key (a document
retrieved by an earlier task counts). Calls are put in a trie, one per *base*: the
model for ``generate`` calls, the input state's key for ``resume`` calls, and for
both the call's namespace, so calls of two tenants never share a state. A trie node
becomes a state when two or more calls pass through it and they do not all continue
into one single child (a branch point, or the end of a call that others extend:
the debate shape). Each state is ``materialize`` of the segments from the base, or
``extend`` of the nearest state above it; each call then resumes from the deepest
state on its path with its remaining segments.

Calls enter the tries in a fixed order, by depth (``graph_opt/order.py``) and then by
key, so the plan is a function of the graph alone, never of the order its dict holds
the tasks in, of ``hash()`` or of a set's order: every scheduler process makes the same.

Token boundaries are not decided here (the scheduler has no tokenizer): the runtime
re-tokenizes the joined text and crops to the longest common token prefix. Nor is the
namespace read from config here (this runs on the scheduler, whose config is not the
client's): it is the ``namespace`` argument the client fixed on each call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dask._task_spec import DataNode, Task, TaskRef
from dask.base import tokenize

from dask_kvstate import tasks
from dask_kvstate.graph_opt.order import call_depths

CHARS_PER_TOKEN = 4  # for estimates only; the runtime counts real tokens


class StateflowError(ValueError):
    """The stateflow pass could not understand a task; the message names it."""


@dataclass(frozen=True)
class Segment:
    """One prompt segment: a literal string, or the key of an upstream task."""

    kind: str  # "text" or "key"
    value: Any  # the text (a str), or the upstream task's key

    def arg(self):
        return self.value if self.kind == "text" else TaskRef(self.value)

    @property
    def chars(self) -> int | None:
        return len(self.value) if self.kind == "text" else None

    def label(self) -> str:
        if self.kind == "key":
            return f"<{self.value}>"
        text = self.value.replace("\n", "\\n")
        return repr(text if len(text) <= 24 else text[:21] + "...")


class Base(NamedTuple):
    """What a call's prompt starts from: a model's empty context, or an upstream state."""

    state: object  # the input state's key (resume), or None (generate)
    model: str | None
    namespace: str | None  # the call's tenant; None: the worker's (a task built without one)


@dataclass
class LLMCall:
    key: object
    task: Task
    base: Base
    segments: tuple[Segment, ...]
    gen_kwargs: dict
    depth: int = 0  # LLM calls on the longest dependency chain above this one


@dataclass
class StateNode:
    """A KV state the pass inserts."""

    key: str
    op: str  # "materialize" or "extend"
    parent: object  # key of the input state (extend), or None
    segments: tuple[Segment, ...]  # what it adds on top of its parent (or base)
    model: str | None
    namespace: str | None  # that of the calls it serves
    prefix_chars: int  # literal characters from the base through this state
    has_key_segment: bool  # the prefix includes an upstream document of unknown size
    consumers: list = field(default_factory=list)  # call keys resuming from it
    children: list = field(default_factory=list)  # state keys extending it


@dataclass
class Plan:
    """What the pass does to one graph."""

    calls: list[LLMCall]
    states: dict[str, StateNode]
    resumes: dict  # call key -> (state key, remaining segments)

    @property
    def empty(self) -> bool:
        return not self.states

    def chars_avoided(self) -> int:
        """Literal prompt characters not prefilled again (one prefill per state instead of per call)."""
        total = 0
        for st in self.states.values():
            users = len(st.consumers) + len(st.children)
            total += (users - 1) * _own_chars(st)
        return total

    def tokens_avoided_estimate(self) -> int:
        return self.chars_avoided() // CHARS_PER_TOKEN


def _own_chars(st: StateNode) -> int:
    return sum(s.chars or 0 for s in st.segments)


def _is(func, target) -> bool:
    # Identity first; the qualified name covers a function unpickled on the scheduler
    # from another import of the module.
    return func is target or (
        getattr(func, "__module__", None) == target.__module__ and getattr(func, "__name__", None) == target.__name__
    )


def _segment(key, i: int, arg) -> Segment:
    if isinstance(arg, DataNode):
        arg = arg.value
    if isinstance(arg, str):
        return Segment("text", arg)
    if isinstance(arg, TaskRef):
        return Segment("key", arg.key)
    raise StateflowError(
        f"kvstate stateflow pass: task {key!r} has prompt segment {i} of type {type(arg).__name__} "
        f"({arg!r:.60}); segments must be str or the result of an upstream task"
    )


def find_calls(dsk: Mapping) -> list[LLMCall]:
    """Every ``kvs.generate`` / ``kvs.resume`` task of ``dsk``, with its segments and depth.

    Sorted by depth, then by key: upstream calls first, and the same list for the same
    graph whatever order its dict holds the tasks in.
    """
    calls = []
    for key, task in dsk.items():
        if not isinstance(task, Task):
            continue
        if _is(task.func, tasks.generate):
            segs = tuple(_segment(key, i, a) for i, a in enumerate(task.args))
            state = None
        elif _is(task.func, tasks.resume):
            if not task.args or not isinstance(task.args[0], TaskRef):
                continue  # a literal state: nothing upstream to share
            segs = tuple(_segment(key, i + 1, a) for i, a in enumerate(task.args[1:]))
            state = task.args[0].key
        else:
            continue
        if not segs and state is None:
            continue
        base = Base(state, task.kwargs.get("model"), task.kwargs.get("namespace"))
        calls.append(LLMCall(key, task, base, segs, dict(task.kwargs)))
    if not calls:
        return calls
    depths = call_depths(dsk, {c.key for c in calls})
    for call in calls:
        call.depth = depths[call.key]
    return sorted(calls, key=lambda c: (c.depth, str(c.key)))


class _TrieNode:
    __slots__ = ("children", "ends", "through")

    def __init__(self):
        self.children: dict[Segment, _TrieNode] = {}
        self.through = 0  # calls whose path reaches this node
        self.ends: list = []  # calls whose path ends here


def make_plan(dsk: Mapping, *, min_shared_chars: int = 0) -> Plan:
    """Plan the state tasks for ``dsk``. Raises :class:`StateflowError` naming a bad task."""
    calls = find_calls(dsk)
    tries: dict[Base, _TrieNode] = {}
    for call in calls:
        node = tries.setdefault(call.base, _TrieNode())
        for seg in call.segments:
            node = node.children.setdefault(seg, _TrieNode())
            node.through += 1
        node.ends.append(call)

    states: dict[str, StateNode] = {}
    deepest: dict = {}  # call key -> (state key, segments the state covers)

    def walk(node: _TrieNode, base: Base, path: tuple[Segment, ...], parent: StateNode | None, since: int):
        here = parent
        if path and node.through >= 2:
            single_child = len(node.children) == 1 and not node.ends
            continuing = single_child and next(iter(node.children.values())).through == node.through
            chars = sum(s.chars or 0 for s in path)
            has_key = any(s.kind == "key" for s in path)
            if not continuing and (has_key or chars >= min_shared_chars):
                here = _new_state(base, path, parent, since, chars, has_key)
                states[here.key] = here
                if parent is not None:
                    parent.children.append(here.key)
                since = len(path)
        for call in node.ends:
            if here is not None:
                deepest[call.key] = (here.key, since)
        for seg, child in node.children.items():
            walk(child, base, (*path, seg), here, since)

    for base, root in tries.items():
        walk(root, base, (), None, 0)

    resumes = {}
    for call in calls:
        if call.key in deepest:
            skey, since = deepest[call.key]
            states[skey].consumers.append(call.key)
            resumes[call.key] = (skey, call.segments[since:])
    return Plan(calls, states, resumes)


def _new_state(base: Base, path, parent: StateNode | None, since: int, chars: int, has_key: bool) -> StateNode:
    own = path[since:]
    parent_key: object
    if parent is not None:
        op, parent_key = "extend", parent.key
    elif base.state is not None:
        op, parent_key = "extend", base.state
    else:
        op, parent_key = "materialize", None
    # The namespace is in the key: equal prefixes of two tenants are two tasks.
    token = tokenize(op, parent_key, base.model, base.namespace, [(s.kind, s.value) for s in own])
    return StateNode(f"kvs-{op}-{token}", op, parent_key, own, base.model, base.namespace, chars, has_key)
