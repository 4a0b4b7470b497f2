"""The stateful graph compiler (installed as ``dask_kvstate.graph_opt``).

A ``delayed_optimize`` pass that turns textflow into stateflow: users write plain
``kvs.generate(...)`` calls; calls that share leading prompt segments get one
``materialize`` (and ``extend`` for nested or iterative sharing) and ``resume`` from it.

Under a distributed Client the pass runs in the scheduler process, so this package
imports no model and no torch (``dask_kvstate.tasks`` is referenced, never called).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque

import dask
import dask.config
from dask.delayed import optimize as _delayed_optimize
from dask.highlevelgraph import HighLevelGraph

from dask_kvstate import config
from dask_kvstate.graph_opt.explain import StatePlan
from dask_kvstate.graph_opt.plan import StateflowError, make_plan
from dask_kvstate.graph_opt.rewrite import apply_plan

__all__ = ["StatePlan", "StateflowError", "explain", "optimize", "recent_plans", "stateflow"]

logger = logging.getLogger("dask_kvstate")

#: The last plans made in this process (where the pass ran: the scheduler, under a Client).
RECENT_PLANS: deque[dict] = deque(maxlen=32)


def recent_plans() -> list[dict]:
    """Summaries of the last plans made in this process (``client.run_on_scheduler(recent_plans)``)."""
    return list(RECENT_PLANS)


def optimize(dsk, keys, **kwargs) -> HighLevelGraph:
    """``delayed_optimize``: Dask's own delayed optimisation, then the stateflow rewrite.

    Keys are never renamed; with nothing shared the graph comes back as Dask's pass left
    it. Raises :class:`StateflowError` naming the task it could not understand.
    """
    hlg = _delayed_optimize(dsk, keys, **kwargs)
    # hlg.to_dict(), never dict(hlg): dict() looks every key up through
    # HighLevelGraph.__getitem__, which scans the layers one by one, and a delayed graph
    # has a layer per task, so dict(hlg) is quadratic (15 s of scheduler CPU measured for a
    # 10,000-task graph with no LLM call in it). to_dict() is one pass and
    # caches its dict on the graph, where the scheduler's materialisation finds it again.
    plan = make_plan(hlg.to_dict(), min_shared_chars=int(config.get("compiler.min-shared-chars")))
    RECENT_PLANS.append(
        {
            "calls": len(plan.calls),
            "states": len(plan.states),
            "resumes": len(plan.resumes),
            "tokens_avoided_estimate": plan.tokens_avoided_estimate(),
        }
    )
    if plan.empty:
        return hlg
    logger.info(
        "kvstate stateflow: %d states for %d of %d LLM calls", len(plan.states), len(plan.resumes), len(plan.calls)
    )
    return apply_plan(hlg, plan)


@contextlib.contextmanager
def stateflow():
    """Enable the compiler for the computations inside.

    Examples
    --------
    >>> import dask, dask_kvstate as kvs
    >>> with kvs.stateflow():
    ...     dask.config.get("delayed_optimize") is kvs.optimize
    True
    """
    with dask.config.set(delayed_optimize=optimize):
        yield


def explain(*delayed, min_shared_chars: int | None = None) -> StatePlan:
    """The state plan the compiler would make for these ``Delayed`` objects.

    ``print(kvs.explain(a, b))`` gives the text; ``.to_dot()`` the graphviz source,
    with state edges dashed.
    """
    if min_shared_chars is None:
        min_shared_chars = int(config.get("compiler.min-shared-chars"))
    graphs = [d.__dask_graph__() for d in delayed]
    keys = [d.key for d in delayed]
    hlg = _delayed_optimize(HighLevelGraph.merge(*graphs), keys)
    return StatePlan(make_plan(hlg.to_dict(), min_shared_chars=min_shared_chars), keys)
