"""Dependency order for the compiler: how deep each LLM call sits, and a cycle check.

Batching siblings (``graph_opt/batch.py``) merges several calls into one task, which
takes on the inputs of all of them. That is only safe when no member can reach another
member, directly or through other batches and plain tasks: otherwise the batch would
wait on its own output. The rule that makes this hold for every graph is a *depth*:
the number of LLM calls on the longest dependency chain above a call. A call that
depends on another, through any number of non-LLM tasks, is strictly deeper, so calls
of equal depth are never ancestors of one another; and since every edge of the
rewritten graph that enters a batch comes from something shallower than its members,
no chain of batches can lead back to where it started (docs/design/compiler.md).
:func:`find_cycle` checks the rewritten graph all the same, as the last line of defence.

Everything here reads the graph's own dependencies and orders by them and by keys,
never by ``hash()`` or set iteration, so the plan is the same under every
``PYTHONHASHSEED``.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping

from dask._task_spec import GraphNode
from dask.core import keys_in_tasks


def dependencies(dsk: Mapping, key: Hashable) -> list:
    """The keys of ``dsk`` that task ``key`` reads, in a fixed order (sorted by ``str``).

    Keys the graph does not hold (persisted results, futures) are left out: nothing in
    this graph can depend on them in turn.
    """
    task = dsk[key]
    if isinstance(task, GraphNode):
        deps: Iterable = (d for d in task.dependencies if d in dsk)
    else:
        deps = keys_in_tasks(dsk, [task])
    return sorted(deps, key=str)


def call_depths(dsk: Mapping, calls: Collection) -> dict:
    """``{call key: depth}``: LLM calls (keys in ``calls``) on the longest chain above each.

    A call with no LLM call upstream has depth 0; one that reads the output of a depth-0
    call, directly or through plain tasks, has depth 1, and so on. Iterative, linear in
    the ancestors of the calls. Raises ``StateflowError`` naming the keys of a cycle in
    ``dsk`` (a graph Dask could not run either).
    """
    from dask_kvstate.graph_opt.plan import StateflowError

    calls = frozenset(calls)  # membership only: the walk's order comes from sorted keys
    # below[k]: the most LLM calls on a chain ending just above k (k itself not counted).
    below: dict = {}
    on_path: dict = {}
    for root in sorted(calls, key=str):
        if root in below:
            continue
        on_path[root] = None
        first = dependencies(dsk, root)
        stack = [(root, first, iter(first))]
        while stack:
            key, deps, todo = stack[-1]
            dep = next(todo, None)
            if dep is None:
                stack.pop()
                del on_path[key]
                below[key] = max((below[d] + (d in calls) for d in deps), default=0)
            elif dep in on_path:
                path = list(on_path)
                loop = " -> ".join(map(str, [*path[path.index(dep) :], dep]))
                raise StateflowError(f"kvstate stateflow pass: the graph has a cycle: {loop}")
            elif dep not in below:
                on_path[dep] = None
                more = dependencies(dsk, dep)
                stack.append((dep, more, iter(more)))
    return {k: below[k] for k in calls}


def find_cycle(dsk: Mapping, starts: Iterable) -> list | None:
    """The keys of a cycle through the ancestors of ``starts`` in ``dsk`` (first key
    repeated at the end), or None when there is none.

    Only the ancestors of ``starts`` are visited: checking a rewrite needs only the keys
    it touched, since a cycle must pass through one of them when the rest of the graph is
    the input's (which Dask checks on its own).
    """
    done: set = set()
    for root in sorted(starts, key=str):
        if root in done or root not in dsk:
            continue
        on_path: dict = {root: None}
        stack = [(root, iter(dependencies(dsk, root)))]
        while stack:
            key, deps = stack[-1]
            dep = next(deps, None)
            if dep is None:
                stack.pop()
                del on_path[key]
                done.add(key)
            elif dep in on_path:
                path = list(on_path)
                return [*path[path.index(dep) :], dep]
            elif dep not in done:
                on_path[dep] = None
                stack.append((dep, iter(dependencies(dsk, dep))))
    return None
