"""Component hints (Nalar Table 2): ``stateful``, ``max-concurrency`` and ``batchable``.

Hints live in the config key ``kvstate.scheduling.components``, one mapping per
component (the ``kvstate-component`` annotation of a task, else its key prefix)::

    kvstate:
      scheduling:
        components:
          developer: {stateful: true}              # session affinity (plugins/scheduler/stealing.py)
          tester: {max-concurrency: 4}             # at most 4 tester tasks run at once, cluster-wide
          router: {batchable: true, max-batch: 8}  # ready router tasks on a worker run as one call

``max-concurrency`` is enforced by the scheduler extension ``kvstate-hints``
(``plugins/scheduler/hints.py``); ``batchable`` by its worker half ``kvstate-batching``
(``plugins/worker/batching.py``) for component functions wrapped with :func:`batchable`.

The batch contract: the function given to :func:`batchable` takes a list of argument
tuples and returns a list of results, one per tuple, in order. Each task still calls
the wrapped function with its own arguments and gets its own result. If a batch call
raises, its elements are run again one by one, so an error fails only the tasks whose
own arguments raise (each with its own exception).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dask_kvstate.protocol import BATCHING_WORKER_PLUGIN

HINT_KEYS = ("stateful", "max-concurrency", "batchable", "max-batch")


@dataclass(frozen=True)
class Hints:
    """The validated hints of every component."""

    stateful: frozenset = frozenset()
    limits: dict = field(default_factory=dict)  # component -> max concurrency
    batch: dict = field(default_factory=dict)  # batchable component -> max batch size (None: no cap)


def _positive_int(component: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"kvstate.scheduling.components.{component}.{name} must be a positive int, got {value!r}")
    return value


def parse_hints(components: dict | None) -> Hints:
    """Validate ``kvstate.scheduling.components``; ValueError names the component and hint.

    Examples
    --------
    >>> h = parse_hints({"tester": {"max-concurrency": 2}, "router": {"batchable": True, "max-batch": 8}})
    >>> h.limits, h.batch
    ({'tester': 2}, {'router': 8})
    >>> parse_hints({"tester": {"max-concurrency": 0}})
    Traceback (most recent call last):
    ...
    ValueError: kvstate.scheduling.components.tester.max-concurrency must be a positive int, got 0
    """
    if components is None:
        components = {}
    if not isinstance(components, dict):
        raise ValueError(f"kvstate.scheduling.components must be a mapping, got {components!r}")
    stateful, limits, batch = set(), {}, {}
    for name, h in components.items():
        h = h or {}
        if not isinstance(h, dict):
            raise ValueError(f"kvstate.scheduling.components.{name} must be a mapping of hints, got {h!r}")
        unknown = sorted(set(h) - set(HINT_KEYS))
        if unknown:
            raise ValueError(
                f"kvstate.scheduling.components.{name}: unknown hint(s) {unknown}; known: {list(HINT_KEYS)}"
            )
        for flag in ("stateful", "batchable"):
            if flag in h and not isinstance(h[flag], bool):
                raise ValueError(f"kvstate.scheduling.components.{name}.{flag} must be a bool, got {h[flag]!r}")
        if h.get("stateful"):
            stateful.add(name)
        if h.get("max-concurrency") is not None:
            limits[name] = _positive_int(name, "max-concurrency", h["max-concurrency"])
        cap = h.get("max-batch")
        if cap is not None:
            cap = _positive_int(name, "max-batch", cap)
            if not h.get("batchable"):
                raise ValueError(f"kvstate.scheduling.components.{name}.max-batch needs batchable: true")
        if h.get("batchable"):
            batch[name] = cap
    return Hints(frozenset(stateful), limits, batch)


class BatchedCall:
    """One call of a batchable component: what :func:`batchable` returns.

    Called with one task's arguments, it returns that task's result. On a worker whose
    ``kvstate-batching`` plugin marks its component ``batchable``, the first such task
    to start also takes the other ready tasks of the component on that worker and runs
    them all in one call of ``batch_fn``; those tasks then finish at once with their
    own results. Anywhere else (no hint, no cluster, the local scheduler) it runs
    ``batch_fn([args])[0]``. Picklable when ``batch_fn`` is.
    """

    def __init__(self, batch_fn: Callable[[list[tuple]], Sequence], name: str | None = None):
        if not callable(batch_fn):
            raise TypeError(f"kvs.batchable needs a callable taking a list of argument tuples, got {batch_fn!r}")
        self.batch_fn = batch_fn
        # Peers are matched by name, not identity: a function pickled by value (defined
        # in __main__) unpickles to a new object in every task.
        self.name = name or f"{getattr(batch_fn, '__module__', '')}.{getattr(batch_fn, '__qualname__', repr(batch_fn))}"
        self.__name__ = getattr(batch_fn, "__name__", "batched")  # key names of client.submit / delayed

    def __repr__(self) -> str:
        return f"kvs.batchable({self.name})"

    def __dask_tokenize__(self):
        # As a decorator, the wrapper takes the function's module name, so the function
        # itself cannot be pickled by reference, which is how Dask tokenizes functions.
        code = getattr(self.batch_fn, "__code__", None)
        return "kvs.batchable", self.name, code.co_code if code is not None else repr(self.batch_fn)

    def __reduce__(self):
        # By reference when it is a module attribute (the decorator case), so every task
        # gets the module's object and the function's globals are the module's own.
        mod, qual = getattr(self.batch_fn, "__module__", None), getattr(self.batch_fn, "__qualname__", None)
        if mod and qual and mod != "__main__" and _lookup(mod, qual) is self:
            return _lookup, (mod, qual)
        return BatchedCall, (self.batch_fn, self.name)

    def run(self, calls: list[tuple]) -> list:
        """``batch_fn(calls)``, checked to return one result per call."""
        out = list(self.batch_fn(calls))
        if len(out) != len(calls):
            raise ValueError(f"batchable {self.name} returned {len(out)} results for {len(calls)} calls")
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"batchable {self.name} takes positional arguments only (they form the batch's "
                f"argument tuples), got keywords {sorted(kwargs)}"
            )
        capture = _capturing()
        if capture is not None:  # the batching plugin is reading a peer task's arguments
            capture.append(args)
            return None
        # Inside a task on a worker with the batching plugin (found by name: the core never
        # imports the plugins), the call may run as part of a batch; anywhere else, alone.
        from distributed import get_worker
        from distributed.worker import thread_state

        try:
            plugin: Any = get_worker().plugins.get(BATCHING_WORKER_PLUGIN)  # a BatchingWorkerPlugin
        except ValueError:  # not in a task on a worker
            plugin = None
        key = getattr(thread_state, "key", None)
        if plugin is None or key is None:
            return self.run([args])[0]
        return plugin.run(self, key, args)


def _lookup(module: str, qualname: str):
    import importlib

    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj


def batchable(batch_fn: Callable[[list[tuple]], Sequence] | None = None, *, name: str | None = None):
    """Make a component function batchable: ``batch_fn`` takes a list of argument tuples.

    Submit the result like the per-item function (``client.submit(classify, text,
    key=f"router-{i}")``); tasks of a component hinted ``batchable: true`` that are ready
    on one worker run as one ``batch_fn`` call. For LLM resumes the compiler already
    batches siblings (``kvs.resume_many``); this is the same idea for any component.

    Examples
    --------
    >>> import dask_kvstate as kvs
    >>> @kvs.batchable
    ... def double(calls):
    ...     return [2 * x for (x,) in calls]
    >>> double(21)                      # outside a cluster: a batch of one
    42
    """
    if batch_fn is None:
        return lambda fn: BatchedCall(fn, name)
    return BatchedCall(batch_fn, name)


# A thread-local list while the batching plugin evaluates a peer task's run_spec to read
# its arguments: Dask resolves them (dependencies, nested containers) exactly as for a
# real call, and BatchedCall only records them.
_local = threading.local()


def _capturing() -> list | None:
    return getattr(_local, "capture", None)


def capture_args(run_spec, data: dict) -> tuple:
    """The argument tuple a ``BatchedCall`` task would be called with, without calling it."""
    captured: list = []
    _local.capture = captured
    try:
        run_spec(data)
    finally:
        _local.capture = None
    assert len(captured) == 1, f"expected one batchable call in the task, found {len(captured)}"
    return captured[0]
