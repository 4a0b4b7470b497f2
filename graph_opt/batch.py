"""Batched siblings: the compiler turns the resumes of one state into batch tasks.

Calls that resume from the same state with the same generation settings (the
namespace among them) are siblings of one fork. Instead of one ``resume`` task each, the pass emits one
``tasks.resume_many`` per group of at most ``kvstate.compiler.batch-siblings`` of them,
and each call's key becomes a ``getitem`` of its batch, so keys (and what they hold)
never change. The batch decodes its rows together (``dask_kvstate/backends/batch.py``).

Why the compiler and not the worker: a worker runs tasks on a thread or two, so
sibling resumes there run one after another and never meet; coalescing them at run
time would mean holding a task back in a window, guessing whether a sibling is coming.
The compiler sees all siblings at once in the graph, so the batch is exact and costs no
waiting. Several groups (a cap below the sibling count) let several workers share one
fork's siblings.

Only calls of the same depth (``graph_opt/order.py``) share a batch. Calls resuming from
one state can still depend on one another (each debate turn reads the earlier turns
after its own question), and a batch holding a call and its descendant would wait on
itself; equal depth rules that out, for chains through other batches too.
"""

from __future__ import annotations

import operator

from dask._task_spec import Task, TaskRef, parse_input
from dask.base import tokenize

from dask_kvstate import tasks


def _settings(kwargs: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in kwargs.items()))


def batch_groups(plan, by_key: dict, max_batch: int) -> list[tuple[str, list]]:
    """``[(state key, [call key, ...]), ...]``: the sibling groups worth a batch task.

    Siblings are consumers of one state with the same settings and the same depth, in
    the plan's order. Sampling without a seed is never batched (each such call is its
    own draw anyway).
    """
    if max_batch < 2:
        return []
    groups = []
    for st in plan.states.values():
        by_settings: dict[tuple, list] = {}
        for key in st.consumers:
            call = by_key[key]
            kw = call.gen_kwargs
            if kw.get("temperature") and kw.get("seed") is None:
                continue
            by_settings.setdefault((call.depth, _settings(kw)), []).append(key)
        for keys in by_settings.values():
            if len(keys) < 2:
                continue
            n_groups = -(-len(keys) // max_batch)
            size = -(-len(keys) // n_groups)  # even groups: 16 siblings, cap 12 -> 8 + 8
            groups += [(st.key, keys[i : i + size]) for i in range(0, len(keys), size)]
    return groups


def apply_batches(dsk: dict, plan, by_key: dict, max_batch: int) -> dict[str, list]:
    """Rewrite sibling resumes in ``dsk`` into batch tasks; returns ``{batch key: call keys}``."""
    made = {}
    for state_key, keys in batch_groups(plan, by_key, max_batch):
        kwargs = {k: v for k, v in by_key[keys[0]].gen_kwargs.items() if k != "prefix_cache"}
        suffixes = [[s.arg() for s in plan.resumes[k][1]] for k in keys]
        batch_key = f"kvs-resume_many-{tokenize(state_key, [str(k) for k in keys], kwargs)}"
        assert batch_key not in dsk, f"batch key {batch_key} collides with a task of the graph"
        dsk[batch_key] = Task(batch_key, tasks.resume_many, TaskRef(state_key), parse_input(suffixes), **kwargs)
        for i, k in enumerate(keys):
            dsk[k] = Task(k, operator.getitem, TaskRef(batch_key), i)
        made[batch_key] = keys
    return made
