"""Apply a :class:`Plan` to a graph: insert the state tasks, rewrite the calls.

The result is one HighLevelGraph layer. Inserted state tasks can depend on upstream
tasks that sit in the same layer as their consumers (persisted or merged graphs), so
splitting them into a layer of their own could make the layer graph cyclic; a single
layer cannot. Every annotation of the input survives as a per-key annotation, and the
inserted tasks carry a ``kvstate`` annotation the scheduler plugins can read:
``{"op", "state_input", "consumers"}`` (state edges; everything else is a data edge).
Output keys never change: a rewritten call keeps its key. The layer's name is a token of
what was inserted (never ``hash()``, which is salted per process), and the rewritten
graph is checked for cycles through the keys it touched before it is returned.
"""

from __future__ import annotations

from dask._task_spec import Task, TaskRef
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from dask_kvstate import config, tasks
from dask_kvstate.graph_opt.batch import apply_batches
from dask_kvstate.graph_opt.order import find_cycle
from dask_kvstate.graph_opt.plan import Plan


class KeyAnnotation:
    """A picklable ``key -> value`` annotation (HLG calls callables once per key)."""

    def __init__(self, values: dict, default=None):
        self.values = values
        self.default = default

    def __call__(self, key):
        return self.values.get(key, self.default)


def state_task(st) -> Task:
    """The task of an inserted state, with the namespace of the calls it serves (never the
    worker's or the scheduler's config)."""
    args = [s.arg() for s in st.segments]
    if st.op == "materialize":
        return Task(st.key, tasks.materialize, *args, namespace=st.namespace, model=st.model)
    return Task(st.key, tasks.extend, TaskRef(st.parent), *args, namespace=st.namespace, model=st.model)


def resume_task(call, state_key, remaining) -> Task:
    # prefix_cache is text replay's own switch; a resume reuses its state instead. The
    # call's namespace goes along with its other keywords.
    kwargs = {k: v for k, v in call.gen_kwargs.items() if k != "prefix_cache"}
    return Task(call.key, tasks.resume, TaskRef(state_key), *[s.arg() for s in remaining], **kwargs)


def per_key_annotations(hlg: HighLevelGraph) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for layer in hlg.layers.values():
        for name, value in (layer.annotations or {}).items():
            out.setdefault(name, {}).update({k: (value(k) if callable(value) else value) for k in layer})
    return out


def _inherit(plan: Plan, per_key: dict[str, dict]) -> None:
    """Give each state task the annotations all its users agree on (workers, resources,
    retries, ...): the prefill then runs where the calls it serves may run."""
    for st in reversed(list(plan.states.values())):  # children before parents
        users = [*st.consumers, *st.children]
        for values in per_key.values():
            got = [values.get(u) for u in users]
            if got and got[0] is not None and all(g == got[0] for g in got):
                values[st.key] = got[0]


def apply_plan(hlg: HighLevelGraph, plan: Plan) -> HighLevelGraph:
    # A copy of to_dict() (one pass; dict(hlg) is quadratic in the layers), since it is
    # changed below and to_dict() returns the graph's cached dict.
    dsk = dict(hlg.to_dict())
    by_key = {c.key: c for c in plan.calls}
    for call_key, (state_key, remaining) in plan.resumes.items():
        dsk[call_key] = resume_task(by_key[call_key], state_key, remaining)
    for st in plan.states.values():
        assert st.key not in hlg, f"inserted state key {st.key} collides with a task of the graph"
        dsk[st.key] = state_task(st)

    batches = apply_batches(dsk, plan, by_key, int(config.get("compiler.batch-siblings")))
    in_batch = {k: b for b, keys in batches.items() for k in keys}

    per_key = per_key_annotations(hlg)
    _inherit(plan, per_key)
    for b, keys in batches.items():  # a batch runs where all its calls may run
        for values in per_key.values():
            got = [values.get(k) for k in keys]
            if got[0] is not None and all(g == got[0] for g in got):
                values[b] = got[0]
    annotations = {name: KeyAnnotation(values) for name, values in per_key.items()}
    annotations["kvstate"] = KeyAnnotation(
        {
            st.key: {
                "op": st.op,
                "state_input": st.parent,
                "consumers": sorted({str(in_batch.get(k, k)) for k in st.consumers + st.children}),
            }
            for st in plan.states.values()
        }
    )
    # The plan cannot make a cycle (states hold only their calls' own prefixes, batches
    # only calls of one depth); one here is a compiler bug, stopped here with its keys
    # rather than handed to the scheduler as a graph it cannot run.
    touched = [*plan.states, *batches, *plan.resumes]
    cycle = find_cycle(dsk, touched)
    assert cycle is None, "kvstate stateflow pass made a cycle: " + " -> ".join(map(str, cycle or ()))
    name = f"kvstate-stateflow-{tokenize(sorted(plan.states), sorted(batches))}"
    return HighLevelGraph({name: MaterializedLayer(dsk, annotations=annotations)}, {name: set()})
