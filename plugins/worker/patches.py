"""Every patch of distributed's internals on a worker: what it wraps, who installs it, why.

Dask's public worker API (``WorkerPlugin`` hooks, handlers under our own names) serves the
rest of the worker plugins. These two replace objects of *one* ``Worker``, installed and
removed through :data:`PATCHES` only (:mod:`dask_kvstate.patching`); the plugins hand the
registry their wrappers. The contract test (``tests/test_distributed_contract.py``) checks
each hook on a real Worker of the installed distributed.

``memory_manager.data`` counts as a patch: ``Worker(data=...)`` is the documented way to
give a worker its own mapping, but a plugin arrives after the worker is built, so it
replaces the attribute the memory monitor reads instead.
"""

from __future__ import annotations

from typing import Any

from dask_kvstate.patching import Hook, Patch, Registry

#: The ``by`` of each group of patches.
SCHEDULING = "scheduling"
SPILL = "spill"

STATE_CLASS = "Worker.state.__class__"
MEMORY_DATA = "Worker.memory_manager.data"


def _put_state_class(w: Any, cls: type) -> None:
    w.state.__class__ = cls


def _put_memory_data(w: Any, data: Any) -> None:
    w.memory_manager.data = data


#: Every worker patch, in layer order (the first on a hook is innermost).
PATCHES = Registry(
    "worker",
    [
        Patch(
            Hook(STATE_CLASS, get=lambda w: type(w.state), put=_put_state_class, params=None),
            SCHEDULING,
            "WorkerState has slots and no hook for its choice of the next task: a subclass adding no slots "
            "starts the first constrained task whose resources are free",
            needs=(
                "state._next_ready_task()",
                "state._resource_restrictions_satisfied(ts)",
                "state.constrained.sorted",
                "state.constrained.discard",
            ),
        ),
        Patch(
            Hook(MEMORY_DATA, get=lambda w: w.memory_manager.data, put=_put_memory_data, params=None),
            SPILL,
            "the memory monitor spills only through memory_manager.data's evict(): KV blocks go to disk "
            "before task results",
            needs=("memory_manager._maybe_spill(worker, memory)", "distributed.spill.ManualEvictProto", "state.data"),
        ),
    ],
)
