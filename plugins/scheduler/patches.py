"""Every patch of distributed's internals on the scheduler: what it wraps, who installs it, why.

Dask's public scheduler API (``SchedulerPlugin`` hooks, handlers under our own names,
annotations, restrictions) serves most of the extensions. What it cannot express is listed
here, each an instance-level replacement on one ``Scheduler`` (other schedulers in the
process, and distributed's classes, stay stock), installed and removed through
:data:`PATCHES` only (:mod:`dask_kvstate.patching`). The extensions keep their own
behaviour: each hands the registry the wrappers for the hooks it registered here.

Layers on one hook compose in the order below, first innermost: on the shared transitions
the ``hints`` gate runs outside ``late-binding``, so a limited or batched component is
decided by the gate and everything else reaches late binding (which leaves hinted
components to the gate anyway). The contract test (``tests/test_distributed_contract.py``)
checks each hook on a real Scheduler of the installed distributed; ``setup.cfg`` bounds
distributed to the versions it passed on.
"""

from __future__ import annotations

from typing import Any

from dask_kvstate.patching import MISSING, Hook, Patch, Registry, restore_attribute

#: The ``by`` of each group of patches (one extension, or one part of one).
SESSIONS = "sessions"
STEALING = "stealing"
LATE_BINDING = "late-binding"
HINTS = "hints"

#: Hook names the extensions pass their wrappers under (the transitions' come from :func:`edge`).
UPDATE_GRAPH = "Scheduler.stream_handlers['update-graph']"
WORK_STEALING = "Scheduler.extensions['stealing']"
STEAL_TIME_RATIO = "WorkStealing.steal_time_ratio"
CHECK_IDLE_SATURATED = "Scheduler.check_idle_saturated"
QUEUE_SLOTS_OPENED = "Scheduler.stimulus_queue_slots_maybe_opened"


def edge(start: str, finish: str) -> str:
    """The hook name of the transition ``start -> finish`` in a scheduler's table."""
    return f"Scheduler._TRANSITIONS_TABLE[{start!r}, {finish!r}]"


def _transition(start: str, finish: str) -> Hook:
    key = (start, finish)

    def put(s: Any, func: Any) -> None:
        table = s.__dict__.get("_TRANSITIONS_TABLE")
        if table is None:  # this scheduler only; the class table stays stock
            table = s._TRANSITIONS_TABLE = dict(type(s)._TRANSITIONS_TABLE)
        table[key] = func

    def restore(s: Any, func: Any) -> None:
        put(s, func)
        if s.__dict__["_TRANSITIONS_TABLE"] == type(s)._TRANSITIONS_TABLE:
            del s._TRANSITIONS_TABLE  # the class's table again

    # Scheduler._transition calls each entry as func(self, key, stimulus_id, **kwargs).
    return Hook(
        edge(start, finish), lambda s: s._TRANSITIONS_TABLE[key], put, restore=restore, params=("key", "stimulus_id")
    )


def _method(name: str, params: tuple[str, ...]) -> Hook:
    return Hook(
        f"Scheduler.{name}",
        get=lambda s: getattr(s, name),
        put=lambda s, f: setattr(s, name, f),
        saved=lambda s: s.__dict__.get(name, MISSING),
        restore=restore_attribute(name),
        params=params,
    )


def _stream_handler(op: str, params: tuple[str, ...]) -> Hook:
    def put(s: Any, handler: Any) -> None:
        s.stream_handlers[op] = handler

    return Hook(f"Scheduler.stream_handlers[{op!r}]", lambda s: s.stream_handlers[op], put, params=params)


def _put_stealing(s: Any, ext: Any) -> None:
    if ext is not None:
        s.extensions["stealing"] = ext


def _restore_stealing(s: Any, stock: Any) -> None:
    """Drop a borrowed ``WorkStealing`` (``stock`` None: distributed's config made none)."""
    borrowed = s.extensions.get("stealing")
    if stock is not None or borrowed is None:
        _put_stealing(s, stock)
        return
    del s.extensions["stealing"]
    for name, plugin in list(s.plugins.items()):
        if plugin is borrowed:
            s.remove_plugin(name)
    # A steal reply still on its way needs its handler (an unknown stream op closes the
    # worker's stream): kept then, answered by the detached extension.
    if not borrowed.in_flight and s.stream_handlers.get("steal-response") == borrowed.move_task_confirm:
        del s.stream_handlers["steal-response"]


def _steal_ratio_put(s: Any, func: Any) -> None:
    s.extensions["stealing"].steal_time_ratio = func


def _steal_ratio_restore(s: Any, saved: Any) -> None:
    ext = s.extensions.get("stealing")
    if ext is not None:
        restore_attribute("steal_time_ratio")(ext, saved)


_WAITING = _transition("waiting", "processing")
_QUEUED = _transition("queued", "processing")
_NO_WORKER = _transition("no-worker", "processing")
_MEMORY = _transition("processing", "memory")
_ERRED = _transition("processing", "erred")
_RELEASED = _transition("processing", "released")
_STEALING = Hook(
    WORK_STEALING,
    get=lambda s: s.extensions.get("stealing"),
    put=_put_stealing,
    restore=_restore_stealing,
    params=None,
)
_STEAL_RATIO = Hook(
    STEAL_TIME_RATIO,
    get=lambda s: s.extensions["stealing"].steal_time_ratio,
    put=_steal_ratio_put,
    saved=lambda s: s.extensions["stealing"].__dict__.get("steal_time_ratio", MISSING),
    restore=_steal_ratio_restore,
    params=("ts",),
)

_DISPATCH = ("_add_to_processing(ts, ws, stimulus_id)",)
_LATE = (*_DISPATCH, "queued.discard", "idle_task_count", "_get_prefix_duration(prefix)", "bandwidth")
_GATE = (*_DISPATCH, "decide_worker_non_rootish(ts)", "unrunnable", "tasks")
_FREE = ("tasks",)  # and the recommendations the wrapped exit returns, where the next held task joins

#: Every scheduler patch, in layer order (the first on a hook is innermost).
PATCHES = Registry(
    "scheduler",
    [
        Patch(
            _stream_handler("update-graph", ("client", "submitting_task", "annotations")),
            SESSIONS,
            "SchedulerPlugin.update_graph never sees submitting_task, so sub-graphs could not inherit their parent's "
            "session; the wrapper also counts graphs still being built per session and client",
        ),
        Patch(
            _STEALING,
            STEALING,
            "with distributed.scheduler.work-stealing off, a WorkStealing is borrowed for its move protocol "
            "(owned tasks only; its balance timer never starts)",
            needs=(
                "distributed.stealing.WorkStealing.move_task_request(ts, victim, thief)",
                "distributed.stealing.WorkStealing.move_task_confirm",
                "remove_plugin(name)",
            ),
        ),
        Patch(
            _STEAL_RATIO,
            STEALING,
            "Dask has no 'not yours to steal'; its stealable sets are filled through this method, so owned tasks "
            "answer (None, None)",
            needs=("distributed.stealing.WorkStealing.put_key_in_stealable(ts)",),
        ),
        Patch(
            _method("check_idle_saturated", ("ws", "occ")),
            LATE_BINDING,
            "a worker keeping a thread for a session, or busy on late-bound work, takes no more queued tasks",
            needs=("idle_task_count",),
        ),
        Patch(
            _method("stimulus_queue_slots_maybe_opened", ("stimulus_id",)),
            LATE_BINDING,
            "Dask's asserts each queue pop reaches processing; a late-bound head may wait for a thread instead",
            needs=("queued.peek", "transitions(recommendations, stimulus_id)"),
        ),
        Patch(
            _WAITING, LATE_BINDING, "session tasks wait on the scheduler for a free thread, best priority first", _LATE
        ),
        Patch(_QUEUED, LATE_BINDING, "a held session task goes to a kept or input-holding thread", _LATE),
        Patch(
            _MEMORY,
            LATE_BINDING,
            "a session's finished leaf keeps its thread for the session's next call (the continuation slot)",
            ("queued", "_add_to_processing(ts, ws, stimulus_id)"),
        ),
        Patch(_WAITING, HINTS, "Dask has no hook to refuse a placement: max-concurrency holds excess tasks", _GATE),
        Patch(_NO_WORKER, HINTS, "held tasks are dispatched from no-worker through the same gate", _GATE),
        Patch(_MEMORY, HINTS, "a task leaving processing frees its slot for the next held task", _FREE),
        Patch(_ERRED, HINTS, "a task leaving processing frees its slot for the next held task", _FREE),
        Patch(_RELEASED, HINTS, "a task leaving processing frees its slot for the next held task", _FREE),
    ],
)
