"""Layers over distributed's internals: the mechanism behind each process's patch registry.

Where Dask has no hook for what an extension needs (refuse a placement, read the
``submitting_task`` of a graph, keep a task out of stealing), the extension replaces one of
distributed's objects on *one* Scheduler or Worker. Each such place is a :class:`Hook`, and
each extension's replacement of it a :class:`Patch`, registered in one module per process
(``plugins/scheduler/patches.py``, ``plugins/worker/patches.py``) with what it wraps and why,
so that:

* installing and removing go through :meth:`Registry.install` and :meth:`Registry.remove`
  only, and both are idempotent: installing again replaces that extension's layers,
  removing what is not installed does nothing;
* two extensions wrapping one hook are two layers composed in the registry's order (the
  patch registered first is innermost, next to distributed's own object), rebuilt from
  distributed's object on every change, so either may leave first and no flag on the
  Scheduler or Worker coordinates them;
* the last layer leaving gives distributed's own object back (:attr:`Hook.restore`);
* ``tests/test_distributed_contract.py`` checks every hook still has the shape the
  wrappers rely on, and names the hook and the distributed version when it does not.

The registry keeps its bookkeeping beside the target (a weak mapping), never on it.

Examples
--------
>>> class Target:
...     def greet(self):
...         return "hello"
>>> hook = Hook(
...     "Target.greet", get=lambda t: t.greet, put=lambda t, f: setattr(t, "greet", f),
...     saved=lambda t: t.__dict__.get("greet", MISSING), restore=restore_attribute("greet"),
... )
>>> registry = Registry("doc", [Patch(hook, "inner", "shout"), Patch(hook, "outer", "ask")])
>>> t = Target()
>>> registry.install(t, "outer", {"Target.greet": lambda f: lambda: f() + "?"})
>>> registry.install(t, "inner", {"Target.greet": lambda f: lambda: f().upper()})
>>> t.greet(), registry.installed(t)
('HELLO?', {'Target.greet': ['inner', 'outer']})
>>> registry.remove(t, "outer"); registry.remove(t, "inner")
>>> t.greet(), "greet" in t.__dict__
('hello', False)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

#: What :attr:`Hook.saved` returns when the target has nothing of its own there (an
#: instance attribute over the class's, say): restoring then deletes what was put.
MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()

#: A layer: the object below it (distributed's, or the layer under this one) to its replacement.
Wrap = Callable[[Any], Any]


def restore_attribute(name: str) -> Callable[[Any, Any], None]:
    """A :attr:`Hook.restore` for an instance attribute laid over the class's: delete it when
    the target had none of its own (:data:`MISSING`), else put the saved one back."""

    def restore(target: Any, saved: Any) -> None:
        if saved is MISSING:
            target.__dict__.pop(name, None)
        else:
            setattr(target, name, saved)

    return restore


@dataclass(frozen=True)
class Hook:
    """One of distributed's objects that patches replace, on one Scheduler or Worker.

    ``params`` and the :attr:`Patch.needs` of the patches on it are what the contract test
    checks against the installed distributed; ``params`` is None for an object that is not
    called (a mapping, a class swapped in).
    """

    #: Dotted name of distributed's attribute, e.g. ``Scheduler.stream_handlers['update-graph']``.
    wraps: str
    #: Distributed's object there on a target (raises AttributeError or KeyError when gone).
    get: Callable[[Any], Any]
    #: Put a replacement there.
    put: Callable[[Any, Any], None]
    #: What :attr:`restore` needs to undo every put (default: :attr:`get`).
    saved: Callable[[Any], Any] | None = None
    #: Give distributed's object back, from what :attr:`saved` returned (default: :attr:`put`).
    restore: Callable[[Any, Any], None] | None = None
    #: Parameters of distributed's callable that the wrappers pass or read by name.
    params: tuple[str, ...] | None = ()

    def save(self, target: Any) -> Any:
        return (self.saved or self.get)(target)

    def give_back(self, target: Any, saved: Any) -> None:
        (self.restore or self.put)(target, saved)


@dataclass(frozen=True)
class Patch:
    """One extension's layer over one :class:`Hook`, and why Dask's public API does not serve."""

    hook: Hook
    #: The extension (or part of one) that installs it; its patches go in and out together.
    by: str
    #: Why it is needed, one line.
    why: str
    #: Other attributes the wrapper uses: dotted from the target (``queued.peek``), or from
    #: an import (``distributed.spill.ManualEvictProto``); ``name(a, b)`` also checks that
    #: the callable takes those parameters.
    needs: tuple[str, ...] = field(default=())

    @property
    def wraps(self) -> str:
        return self.hook.wraps


@dataclass
class _Slot:
    saved: Any  # what Hook.restore puts back
    original: Any  # what the innermost layer wraps
    layers: dict[str, tuple[object, Wrap]]  # by -> (owner, wrap)


class Registry:
    """The patches of one process, and the layers installed on each of its targets."""

    def __init__(self, process: str, patches: Sequence[Patch]):
        self.process = process
        self.patches = tuple(patches)
        pairs = [(p.wraps, p.by) for p in self.patches]
        assert len(set(pairs)) == len(pairs), f"{process} patches: a hook registered twice by one extension"
        self._slots: WeakKeyDictionary[Any, dict[str, _Slot]] = WeakKeyDictionary()

    def __iter__(self) -> Iterator[Patch]:
        return iter(self.patches)

    def of(self, by: str) -> tuple[Patch, ...]:
        """The patches ``by`` installs, in registry order."""
        return tuple(p for p in self.patches if p.by == by)

    def install(self, target: Any, by: str, replacements: Mapping[str, Wrap], owner: object = None) -> None:
        """Layer ``by``'s replacements (hook name to :data:`Wrap`) over ``target``'s hooks.

        Each wrap receives the object below its layer and returns what goes in its place;
        it is called again whenever another layer on the same hook comes or goes, so it
        must build its replacement from its argument alone. Installing again for ``by``
        first removes its earlier layers, whoever their owner: the newer extension
        replaced the older (a plugin registered again under its name).
        """
        mine = {p.wraps: p for p in self.of(by)}
        unknown = sorted(set(replacements) - set(mine))
        assert not unknown, f"{by} replaces {unknown}, not registered in the {self.process} patches"
        self.remove(target, by)
        slots = self._slots.setdefault(target, {})
        for p in self.of(by):
            wrap = replacements.get(p.wraps)
            if wrap is None:
                continue
            slot = slots.get(p.wraps)
            if slot is None:
                slot = slots[p.wraps] = _Slot(p.hook.save(target), p.hook.get(target), {})
            slot.layers[by] = (owner, wrap)
            self._apply(target, p.hook, slot)

    def remove(self, target: Any, by: str, owner: object = None) -> None:
        """Take ``by``'s layers off ``target`` (only if installed by ``owner``, when given).

        Undone in reverse registry order; the last layer on a hook gives distributed's
        object back. Never raises for what is not installed.
        """
        slots = self._slots.get(target)
        if not slots:
            return
        for p in reversed(self.of(by)):
            slot = slots.get(p.wraps)
            if slot is None or by not in slot.layers:
                continue
            if owner is not None and slot.layers[by][0] is not owner:
                continue  # a newer extension's layer: it removes its own
            del slot.layers[by]
            if slot.layers:
                self._apply(target, p.hook, slot)
            else:
                del slots[p.wraps]
                p.hook.give_back(target, slot.saved)

    def installed(self, target: Any) -> dict[str, list[str]]:
        """Hook name to the extensions layered on it on ``target``, innermost first."""
        slots = self._slots.get(target) or {}
        out: dict[str, list[str]] = {}
        for p in self.patches:
            slot = slots.get(p.wraps)
            if slot is not None and p.by in slot.layers:
                out.setdefault(p.wraps, []).append(p.by)
        return out

    def _apply(self, target: Any, hook: Hook, slot: _Slot) -> None:
        value = slot.original
        for p in self.patches:  # registry order: the first registered is innermost
            if p.wraps == hook.wraps and p.by in slot.layers:
                value = slot.layers[p.by][1](value)
        hook.put(target, value)
