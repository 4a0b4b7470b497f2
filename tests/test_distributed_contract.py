"""The contract between the registered patches and the installed distributed.

Every place where an extension replaces one of distributed's objects is a record in
``plugins/scheduler/patches.py`` or ``plugins/worker/patches.py``. These tests check each
record against a real Scheduler and Worker: the object it wraps is still there with the
parameters the wrapper passes, the attributes the wrapper uses exist, distributed still
calls through every hook, and removing every patch gives distributed's own objects back.
A failure names the hook and the distributed version: the place to look when
``setup.cfg``'s bound on distributed moves.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections import Counter
from collections.abc import MutableMapping

import distributed
import pytest
from distributed import Event, Worker, wait
from distributed.stealing import WorkStealing
from distributed.utils_test import async_poll_for, gen_cluster, inc
from distributed.worker_state_machine import WorkerState

from dask_kvstate.patching import Patch, Registry
from dask_kvstate.plugins.scheduler.patches import HINTS, LATE_BINDING, edge
from dask_kvstate.plugins.scheduler.patches import PATCHES as SCHEDULER
from dask_kvstate.plugins.worker.patches import MEMORY_DATA, STATE_CLASS
from dask_kvstate.plugins.worker.patches import PATCHES as WORKER

VERSION = distributed.__version__
RECORDS = [(registry, p) for registry in (SCHEDULER, WORKER) for p in registry]
_STEP = re.compile(r"\.?([A-Za-z_]\w*)|\[([^\]]+)\]")


def broken(p: Patch, what: str) -> str:
    return f"distributed {VERSION}: the hook {p.wraps} (patched by {p.by!r}) {what}"


def resolve(target, path: str):
    """``path`` (a dotted name from ``target``, or from an import when it starts with
    ``distributed.``) to its object; ``name[key]`` indexes a mapping."""
    steps = [m.group(1) or m.group(2).strip("'\"") for m in _STEP.finditer(path)]
    obj, rest = target, steps
    if steps[0] == "distributed":
        for i in range(len(steps), 0, -1):
            try:
                obj, rest = importlib.import_module(".".join(steps[:i])), steps[i:]
                break
            except ImportError:
                continue
    for step in rest:
        obj = obj[step] if isinstance(obj, dict) else getattr(obj, step)
    return obj


def missing_params(func, params) -> list[str]:
    names = inspect.signature(func).parameters
    return [p for p in params if p not in names]


def target_of(registry: Registry, s, a):
    return s if registry is SCHEDULER else a


@pytest.mark.parametrize(("registry", "patch"), RECORDS, ids=[f"{p.by}:{p.wraps}" for _, p in RECORDS])
@gen_cluster(nthreads=[("127.0.0.1", 1)])
async def test_hook_has_the_shape_the_patch_relies_on(s, a, registry, patch):
    target = target_of(registry, s, a)
    try:
        original = patch.hook.get(target)
    except (AttributeError, KeyError) as e:
        pytest.fail(broken(patch, f"is gone from a real {type(target).__name__}: {type(e).__name__}: {e}"))
    if patch.hook.params is not None:
        assert callable(original), broken(patch, f"is no longer callable: {original!r}")
        gone = missing_params(original, patch.hook.params)
        assert not gone, broken(patch, f"no longer takes {gone} (it takes {inspect.signature(original)})")
    for need in patch.needs:
        path, _, args = need.partition("(")
        try:
            obj = resolve(target, path)
        except (AttributeError, KeyError, ImportError) as e:
            pytest.fail(broken(patch, f"relies on {path}, which is gone: {type(e).__name__}: {e}"))
        params = [p.strip() for p in args.rstrip(")").split(",") if p.strip()]
        if args:
            assert callable(obj), broken(patch, f"relies on calling {path}, no longer callable")
            gone = missing_params(obj, params)
            assert not gone, broken(patch, f"relies on {path} taking {gone}: it takes {inspect.signature(obj)}")


def test_every_patch_says_why_and_layers_are_ordered():
    for registry, p in RECORDS:
        assert p.why.strip() and p.wraps.strip(), f"{registry.process} patch {p!r} has no reason or hook name"
    on_waiting = [p.by for p in SCHEDULER if p.wraps == edge("waiting", "processing")]
    assert on_waiting == [LATE_BINDING, HINTS]  # the hints gate outside late binding


# -- distributed calls through every hook; removing gives its objects back ------------------

CALLS: Counter = Counter()
ENTERED: list = []


def counting(by: str, hook: str):
    """A pass-through layer counting the calls distributed makes through ``hook``."""

    def wrap(original):
        if inspect.iscoroutinefunction(original):

            async def layer(*args, **kwargs):
                CALLS[by, hook] += 1
                ENTERED.append((by, hook))
                return await original(*args, **kwargs)

        else:

            def layer(*args, **kwargs):
                CALLS[by, hook] += 1
                ENTERED.append((by, hook))
                return original(*args, **kwargs)

        return layer

    return wrap


class CountingState(WorkerState):
    __slots__ = ()

    def _next_ready_task(self):
        CALLS["scheduling", STATE_CLASS] += 1
        return super()._next_ready_task()


class Spy(MutableMapping):
    """``memory_manager.data`` seen by the memory monitor: counts its reads of ``fast``."""

    def __init__(self, data):
        self.data = data

    @property
    def fast(self):
        CALLS["spill", MEMORY_DATA] += 1
        return False  # nothing to spill: the monitor stops there

    def evict(self) -> int:
        return -1

    def __getitem__(self, key):
        return self.data[key]

    def __setitem__(self, key, value):
        self.data[key] = value

    def __delitem__(self, key):
        del self.data[key]

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)


def fail():
    raise ValueError("meant to fail")


def hold(name):
    Event(name).wait()


def layers_for(registry: Registry, target, by: str) -> dict:
    out = {}
    for p in registry.of(by):
        if p.wraps == STATE_CLASS:
            out[p.wraps] = lambda cls: CountingState if cls is WorkerState else cls
        elif p.wraps == MEMORY_DATA:
            out[p.wraps] = Spy
        elif p.hook.params is None:  # the borrowed WorkStealing
            out[p.wraps] = lambda stock: stock if stock is not None else WorkStealing(target)
        else:
            out[p.wraps] = counting(by, p.wraps)
    return out


@gen_cluster(
    client=True,
    worker_kwargs={"memory_limit": "1 TiB"},  # capped at the machine's: the monitor spills only when asked below
    config={
        "distributed.scheduler.work-stealing": False,  # so the stealing group borrows one
        "distributed.worker.memory.spill": 0.7,
        "distributed.worker.memory.target": 0.6,
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.terminate": False,
    },
)
async def test_distributed_calls_through_every_hook_and_gets_its_objects_back(c, s, a, b):
    CALLS.clear()
    ENTERED.clear()
    groups = list(dict.fromkeys(p.by for p in SCHEDULER)), list(dict.fromkeys(p.by for p in WORKER))
    before = {
        "handlers": dict(s.stream_handlers),
        "plugins": set(s.plugins),
        "extensions": set(s.extensions),
        "state": type(a.state),
        "data": a.memory_manager.data,
    }
    assert "stealing" not in s.extensions
    for registry, target, names in ((SCHEDULER, s, groups[0]), (WORKER, a, groups[1])):
        for by in names:
            registry.install(target, by, layers_for(registry, target, by), owner=by)
        registry.install(target, names[-1], layers_for(registry, target, names[-1]), owner="again")  # replaces
    assert SCHEDULER.installed(s)[edge("waiting", "processing")] == [LATE_BINDING, HINTS]
    assert isinstance(s.extensions["stealing"], WorkStealing)
    assert type(a.state) is CountingState and isinstance(a.memory_manager.data, Spy)

    # Work through every hook: plain, failing, queued (root-ish), unrunnable, cancelled tasks.
    assert await c.submit(inc, 1, workers=[a.address]) == 2
    await wait(c.submit(fail))
    assert await c.gather(c.map(inc, range(20))) == list(range(1, 21))
    unrunnable = c.submit(inc, 2, resources={"R": 1})
    await async_poll_for(lambda: unrunnable.key in s.tasks and s.tasks[unrunnable.key].state == "no-worker", 5)
    async with Worker(s.address, nthreads=1, resources={"R": 1}):
        assert await unrunnable == 3
    held = c.submit(hold, "contract-hold")
    await async_poll_for(lambda: held.key in s.tasks and s.tasks[held.key].state == "processing", 5)
    await c.cancel([held])
    await Event("contract-hold").set()
    await a.memory_manager._maybe_spill(a, 2**40)  # far past the spill threshold

    silent = [
        p.wraps
        for registry in (SCHEDULER, WORKER)
        for p in registry
        if p.hook.params is not None or p.wraps in (STATE_CLASS, MEMORY_DATA)
        if not CALLS[p.by, p.wraps]
    ]
    assert not silent, f"distributed {VERSION} no longer calls through {silent}"
    waiting = edge("waiting", "processing")
    assert ENTERED.index((HINTS, waiting)) < ENTERED.index((LATE_BINDING, waiting))  # outer first

    for registry, target, names in ((SCHEDULER, s, groups[0]), (WORKER, a, groups[1])):
        registry.remove(target, names[-1], owner=names[-1])  # not its owner any more: a no-op
        assert registry.installed(target)
        for by in reversed(names):
            registry.remove(target, by)
            registry.remove(target, by)  # twice: nothing left to remove
        assert registry.installed(target) == {}
    for name in ("_TRANSITIONS_TABLE", "check_idle_saturated", "stimulus_queue_slots_maybe_opened"):
        assert name not in s.__dict__, f"distributed {VERSION}: Scheduler.{name} not given back"
    assert dict(s.stream_handlers) == before["handlers"]
    assert set(s.plugins) == before["plugins"] and set(s.extensions) == before["extensions"]
    assert type(a.state) is before["state"] is WorkerState
    assert a.memory_manager.data is before["data"]
    assert await c.submit(inc, 10) == 11  # stock distributed again
