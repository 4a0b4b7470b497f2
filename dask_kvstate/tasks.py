"""The operators as plain functions that run inside a Dask task on a worker.

These are what ``kvs.materialize`` and friends put in the graph, and what to pass to
``client.submit`` when working with futures::

    ref = client.submit(kvs.tasks.materialize, "You are a planner. ", document)
    out = client.submit(kvs.tasks.resume, ref, "Plan the next step.", max_new_tokens=32)

Each finds its worker's ``kvstate`` plugin and hands the work to its runtime.

Each takes the ``namespace`` (tenant) of the client that built the task, which
``kvs.materialize`` and friends fix from the client's config and which is part of the
task's key. ``materialize`` and ``generate`` hash new blocks with it; an operator on a
state hashes with the state's own namespace, whoever calls it: a tenant handed another's
ref may use it, and its blocks stay that ref's. The generating functions take their
decode options and ``generate`` its ``prefix_cache`` the same way, fixed by the client.

A task submitted without them (``client.submit(kvs.tasks.generate, prompt)``) runs with
this worker's ``kvstate.namespace`` and ``kvstate.generate.*`` where an argument is left
None: the one place a worker's config decides a call, and only for tasks not built by
``kvs.*``. Such a task's key is the caller's (``client.submit`` hashes its arguments), so
a sampled call without a seed there is deduplicated unless submitted with ``pure=False``.

Measurements for benchmarks (the rule's estimate, timed fills, a raw Dask fetch) are not
operators and live in :mod:`dask_kvstate.bench.probes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from distributed import get_worker

from dask_kvstate import config
from dask_kvstate.generation import DecodeOptions, Generation, Sampling, decode_options
from dask_kvstate.protocol import WORKER_PLUGIN
from dask_kvstate.state import KVStateRef

if TYPE_CHECKING:
    from typing import Unpack


def _plugin():
    """This task's worker's ``kvstate`` plugin, found by name: the core never imports the plugins."""
    try:
        worker = get_worker()
    except ValueError:
        raise RuntimeError("kvstate operators run inside Dask tasks on a worker; compute them with a Client") from None
    plugin: Any = worker.plugins.get(WORKER_PLUGIN)  # a KVStateWorkerPlugin, not imported here
    if plugin is None or plugin.runtime is None:
        raise RuntimeError(f"worker {worker.address} has no kvstate plugin: call kvs.install(client) first")
    return plugin


def runtime(model: str | None = None):
    """The ``StateRuntime`` of ``model`` (default: the first installed) on this task's worker."""
    return _plugin().runtime_for(model)


def runtime_for_state(state: KVStateRef, model: str | None = None):
    """The named model's runtime, else the state's own model's if loaded here, else the default.

    A state of a model this worker does not run is then recomputed from its text. Raises
    TypeError naming what ``state`` is when it is not a ref (with ``model`` None).
    """
    plugin = _plugin()
    if model is not None:
        return plugin.runtime_for(model)
    return plugin.runtimes.get(_check_state(state).model_name, plugin.runtime)


def join_segments(segments) -> str:
    """Join prompt segments, naming the first one that is not text."""
    for i, s in enumerate(segments):
        if not isinstance(s, str):
            raise TypeError(f"prompt segment {i} is a {type(s).__name__}, not a str: {s!r:.80}")
    return "".join(segments)


def _check_state(state, what: str = "state") -> KVStateRef:
    if not isinstance(state, KVStateRef):
        raise TypeError(
            f"{what} must be a KVStateRef (the result of kvs.materialize, extend, fork, transfer or merge), "
            f"got {type(state).__name__}"
        )
    return state


def _sampling(options: Mapping[str, Any], call: str) -> tuple[str | None, Sampling]:
    """The model named in ``options``, and how to decode.

    A task built by ``kvs.*`` carries every option fixed on its client, so nothing is read
    here; only an option left None (a plain ``client.submit`` of these functions) takes
    this worker's ``kvstate.generate.*``.
    """
    opts = decode_options(options, call)
    return opts["model"], Sampling.from_options(opts)


def _namespace(namespace: str | None) -> str:
    """The task's namespace; the worker's only for a task built without one."""
    return namespace or config.get("namespace")


def materialize(*segments: str, namespace: str | None = None, model: str | None = None) -> KVStateRef:
    """Prefill the joined segments once; returns the state's ref."""
    return runtime(model).materialize(join_segments(segments), _namespace(namespace))


def extend(state: KVStateRef, *segments: str, namespace: str | None = None, model: str | None = None) -> KVStateRef:
    """The state followed by more text (in the state's namespace)."""
    return runtime_for_state(state, model).extend(state, join_segments(segments))


def generate(
    *segments: str, prefix_cache: bool | None = None, namespace: str | None = None, **options: Unpack[DecodeOptions]
) -> Generation:
    """Text replay: generate from the whole joined prompt (with ``prefix_cache``, reusing
    this worker's cached prompt blocks of ``namespace``: the local prefix cache baseline).

    ``prefix_cache`` None (a task not built by ``kvs.generate``) is this worker's
    ``kvstate.generate.prefix-cache``.
    """
    model, sampling = _sampling(options, "generate")
    if prefix_cache if prefix_cache is not None else config.get("generate.prefix-cache"):
        return runtime(model).generate_cached(join_segments(segments), _namespace(namespace), sampling)
    return runtime(model).generate(join_segments(segments), sampling, _namespace(namespace))


def resume_many(
    state: KVStateRef, suffixes: list, *, namespace: str | None = None, **options: Unpack[DecodeOptions]
) -> list[Generation]:
    """Sibling resumes from one state decoded as one batch: one ``Generation`` per suffix.

    ``suffixes`` is a list whose items are each a str or a list of str segments.
    """
    if not isinstance(suffixes, (list, tuple)) or not suffixes:
        raise ValueError(f"resume_many needs a non-empty list of suffixes, got {suffixes!r:.80}")
    texts = [join_segments(s if isinstance(s, (list, tuple)) else [s]) for s in suffixes]
    model, sampling = _sampling(options, "resume_many")
    return runtime_for_state(_check_state(state), model).resume_many(state, texts, sampling)


def resume(
    state: KVStateRef, *segments: str, namespace: str | None = None, **options: Unpack[DecodeOptions]
) -> Generation:
    """Generate from the state followed by the segments (same tokens as text replay)."""
    model, sampling = _sampling(options, "resume")
    return runtime_for_state(state, model).resume(state, join_segments(segments), sampling)


def fork(state: KVStateRef, k: int, namespace: str | None = None) -> list[KVStateRef]:
    """``k`` copy-on-write children of the state."""
    return runtime_for_state(state, None).fork(state, k)


def merge(*states: KVStateRef, policy: str = "concat", namespace: str | None = None) -> KVStateRef:
    """Restricted composition of states (see ``kvs.merge``)."""
    rt = runtime_for_state(states[0], None) if states and isinstance(states[0], KVStateRef) else runtime()
    return rt.merge(states, policy)


def transfer(state: KVStateRef, namespace: str | None = None) -> KVStateRef:
    """Make the worker running this task the state's holder."""
    return runtime_for_state(state, None).transfer(state)


def evict(state: KVStateRef, namespace: str | None = None) -> int:
    """Free the state's blocks here and on its holder; returns the bytes freed.

    Blocks still used by another live state (a fork, an extension) stay. A holder
    that is gone is skipped: its blocks went with it.
    """
    return _plugin().evict_everywhere(_check_state(state))
