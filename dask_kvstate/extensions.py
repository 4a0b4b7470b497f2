"""Which kvstate extensions a cluster runs: one ``enabled`` key each, read here only.

``kvs.install`` and the preload (``dask_kvstate.plugins``) both build their plugins with
:func:`extensions`, so a cluster set up from a client and one started from the command
line run the same extensions, in the same order.

Each extension has a short name, the one ``kvs.install``'s overrides and ``kvs.stats``'
sections use, and one config key:

==========  ================================  =====================================
name        key (under ``kvstate.``)           scheduler extension (+ worker half)
==========  ================================  =====================================
placement   ``placement.enabled``              KV-aware placement
dashboard   ``dashboard.enabled``              observe: stats history, ``/kvstate``
sessions    ``scheduling.sessions.enabled``    session tracker (+ scheduling half)
priority    ``scheduling.priority.enabled``    workflow-progress priority
stealing    ``scheduling.stealing.enabled``    late-binding stealing
capacity    ``scheduling.capacity.enabled``    capacity between agent roles
hints       ``scheduling.hints.enabled``       component hints, when a hint asks
lifecycle   ``lifecycle.enabled``              KV lifecycle (+ lifecycle half)
==========  ================================  =====================================

The session tracker is also installed whenever another scheduling extension or the
lifecycle is, because they read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dask_kvstate import config

if TYPE_CHECKING:
    from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

#: Each extension's short name and the key that switches it.
SWITCHES = {
    "placement": "placement.enabled",
    "dashboard": "dashboard.enabled",
    "sessions": "scheduling.sessions.enabled",
    "priority": "scheduling.priority.enabled",
    "stealing": "scheduling.stealing.enabled",
    "capacity": "scheduling.capacity.enabled",
    "hints": "scheduling.hints.enabled",
    "lifecycle": "lifecycle.enabled",
}
#: What ``scheduling=True`` / ``False`` switches, and the keys a ``scheduling={...}`` mapping may name.
SCHEDULING = ("sessions", "priority", "stealing", "capacity", "hints")
#: Extensions that serve KV state, so they need the ``kvstate`` worker plugin and its block store.
NEED_STORE = ("placement", "dashboard", "lifecycle")


def enabled(scheduling: bool | Mapping[str, bool] | None = None, lifecycle: bool | None = None) -> dict[str, bool]:
    """``{name: on}`` for every extension: the config's ``enabled`` keys, then the overrides.

    ``scheduling=True`` / ``False`` switches all of :data:`SCHEDULING` on / off; a
    mapping such as ``{"priority": True, "stealing": False}`` switches the ones it
    names. ``lifecycle`` switches the lifecycle. ``None`` keeps the config's choice.
    Raises ValueError naming a key or override that is not a bool, or an unknown name.

    Examples
    --------
    >>> on = enabled(scheduling={"stealing": True}, lifecycle=False)
    >>> on["stealing"], on["lifecycle"], on["placement"]
    (True, False, True)
    >>> enabled(scheduling=True)["capacity"]
    True
    """
    on = {}
    for name, key in SWITCHES.items():
        value = config.get(key)
        if not isinstance(value, bool):
            raise ValueError(f"kvstate.{key} must be a bool, got {value!r}")
        on[name] = value
    if isinstance(scheduling, bool):
        on.update(dict.fromkeys(SCHEDULING, scheduling))
    elif isinstance(scheduling, Mapping):
        unknown = sorted(set(scheduling) - set(SCHEDULING))
        if unknown:
            raise ValueError(f"scheduling= names unknown extension(s) {unknown}; known: {list(SCHEDULING)}")
        for name, value in scheduling.items():
            if not isinstance(value, bool):
                raise ValueError(f"scheduling={{{name!r}: ...}} must be a bool, got {value!r}")
        on.update(scheduling)
    elif scheduling is not None:
        raise ValueError(f"scheduling= must be None, a bool or a mapping of bools, got {scheduling!r}")
    if lifecycle is not None:
        if not isinstance(lifecycle, bool):
            raise ValueError(f"lifecycle= must be None or a bool, got {lifecycle!r}")
        on["lifecycle"] = lifecycle
    return on


@dataclass
class Extensions:
    """The plugins a cluster runs: what to add to the scheduler, then to every worker."""

    #: Scheduler extensions in the order they are added (the session tracker before its readers).
    scheduler: list[SchedulerPlugin] = field(default_factory=list)
    #: Worker halves, each set up after the ``kvstate`` worker plugin where there is one
    #: (the lifecycle half times moves on its store).
    worker: list[WorkerPlugin] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """The scheduler extensions' names, in order."""
        return [p.name for p in self.scheduler]  # type: ignore[attr-defined]


def extensions(on: Mapping[str, bool]) -> Extensions:
    """The extensions (and worker halves) that ``on`` (see :func:`enabled`) switches on.

    Builds them, so a bad setting raises its plugin's ValueError here, before anything
    reaches a cluster. The hints extension comes only when a hint in
    ``kvstate.scheduling.components`` asks for it (max-concurrency or batchable).

    Examples
    --------
    >>> ext = extensions({"sessions": True, "stealing": True})
    >>> [type(p).__name__ for p in ext.scheduler], [type(p).__name__ for p in ext.worker]
    (['SessionTracker', 'LateBindingStealing'], ['SchedulingWorkerPlugin'])
    >>> extensions({}).scheduler
    []
    >>> import dask
    >>> with dask.config.set({"kvstate.scheduling.components": {"tester": {"max-concurrency": 2}}}):
    ...     extensions({"hints": True}).names, extensions({"hints": False}).names
    (['kvstate-sessions', 'kvstate-hints'], [])
    """
    from dask_kvstate.hints import parse_hints
    from dask_kvstate.plugins.scheduler.capacity import CapacityController
    from dask_kvstate.plugins.scheduler.hints import ComponentHints
    from dask_kvstate.plugins.scheduler.lifecycle import KVLifecycle
    from dask_kvstate.plugins.scheduler.observe import KVObserver
    from dask_kvstate.plugins.scheduler.placement import KVPlacement
    from dask_kvstate.plugins.scheduler.priority import ProgressPriority
    from dask_kvstate.plugins.scheduler.sessions import SessionTracker
    from dask_kvstate.plugins.scheduler.stealing import LateBindingStealing
    from dask_kvstate.plugins.worker.lifecycle import KVLifecycleWorkerPlugin
    from dask_kvstate.plugins.worker.scheduling import SchedulingWorkerPlugin

    out = Extensions()
    if on.get("placement"):
        out.scheduler.append(KVPlacement())
    if on.get("dashboard"):
        out.scheduler.append(KVObserver())
    policies: list[SchedulerPlugin] = [
        cls()
        for name, cls in (
            ("priority", ProgressPriority),
            ("stealing", LateBindingStealing),
            ("capacity", CapacityController),
        )
        if on.get(name)
    ]
    if on.get("hints"):
        hints = parse_hints(config.get("scheduling.components"))
        if hints.limits or hints.batch:
            policies.append(ComponentHints())
    scheduling = bool(policies) or bool(on.get("sessions"))
    if scheduling or on.get("lifecycle"):
        out.scheduler.append(SessionTracker())
    out.scheduler.extend(policies)
    if scheduling:
        out.worker.append(SchedulingWorkerPlugin())
    if on.get("lifecycle"):
        out.scheduler.append(KVLifecycle())
        out.worker.append(KVLifecycleWorkerPlugin())
    return out
