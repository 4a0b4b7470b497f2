"""The operators as plain functions that run inside a Dask task on a worker.

These are what ``kvs.materialize`` and friends put in the graph, and what to pass to
``client.submit`` when working with futures::

    ref = client.submit(kvs.tasks.materialize, "You are a planner. ", document)
    out = client.submit(kvs.tasks.resume, ref, "Plan the next step.", max_new_tokens=32)

Each finds its worker's ``kvstate`` plugin and hands the work to its runtime.
"""

from __future__ import annotations

import contextlib
import time

from distributed import get_worker
from distributed.utils import sync

from dask_kvstate import config
from dask_kvstate.generation import Generation
from dask_kvstate.state import KVStateRef


def _plugin():
    from dask_kvstate.plugins.worker.plugin import PLUGIN_NAME

    try:
        worker = get_worker()
    except ValueError:
        raise RuntimeError("kvstate operators run inside Dask tasks on a worker; compute them with a Client") from None
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is None or plugin.runtime is None:
        raise RuntimeError(f"worker {worker.address} has no kvstate plugin: call kvs.install(client) first")
    return plugin


def runtime(model: str | None = None):
    """The ``StateRuntime`` of ``model`` (default: the first installed) on this task's worker."""
    return _plugin().runtime_for(model)


def _runtime_for_state(state: KVStateRef, model: str | None):
    """The named model's runtime, else the state's own model's if loaded here, else the default.

    A state of a model this worker does not run is then recomputed from its text.
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


def _gen_params(max_new_tokens, temperature, top_p, seed) -> dict:
    p = {
        "max_new_tokens": config.get("generate.max-new-tokens") if max_new_tokens is None else max_new_tokens,
        "temperature": config.get("generate.temperature") if temperature is None else temperature,
        "top_p": config.get("generate.top-p") if top_p is None else top_p,
        "seed": seed,
    }
    if not isinstance(p["max_new_tokens"], int) or p["max_new_tokens"] < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {p['max_new_tokens']!r}")
    if p["temperature"] < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {p['temperature']!r}")
    if not 0 < p["top_p"] <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p['top_p']!r}")
    return p


def materialize(*segments: str, namespace: str | None = None, model: str | None = None) -> KVStateRef:
    """Prefill the joined segments once; returns the state's ref."""
    return runtime(model).materialize(join_segments(segments), namespace or config.get("namespace"))


def extend(state: KVStateRef, *segments: str, model: str | None = None) -> KVStateRef:
    """The state followed by more text."""
    return _runtime_for_state(state, model).extend(state, join_segments(segments))


def generate(
    *segments: str,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    model: str | None = None,
    prefix_cache: bool | None = None,
) -> Generation:
    """Text replay: generate from the whole joined prompt (with ``prefix_cache``, reusing
    this worker's cached prompt blocks: the local prefix cache baseline)."""
    params = _gen_params(max_new_tokens, temperature, top_p, seed)
    if prefix_cache if prefix_cache is not None else config.get("generate.prefix-cache", False):
        from dask_kvstate.plugins.worker import prefix_cache as pc

        return pc.generate(runtime(model), join_segments(segments), config.get("namespace"), **params)
    return runtime(model).generate(join_segments(segments), **params)


def resume_many(
    state: KVStateRef,
    suffixes: list,
    *,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    model: str | None = None,
) -> list[Generation]:
    """Sibling resumes from one state decoded as one batch: one ``Generation`` per suffix.

    ``suffixes`` is a list whose items are each a str or a list of str segments.
    """
    if not isinstance(suffixes, (list, tuple)) or not suffixes:
        raise ValueError(f"resume_many needs a non-empty list of suffixes, got {suffixes!r:.80}")
    texts = [join_segments(s if isinstance(s, (list, tuple)) else [s]) for s in suffixes]
    return _runtime_for_state(_check_state(state), model).resume_many(
        state, texts, **_gen_params(max_new_tokens, temperature, top_p, seed)
    )


def resume(
    state: KVStateRef,
    *segments: str,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    model: str | None = None,
) -> Generation:
    """Generate from the state followed by the segments (same tokens as text replay)."""
    return _runtime_for_state(state, model).resume(
        state, join_segments(segments), **_gen_params(max_new_tokens, temperature, top_p, seed)
    )


def fork(state: KVStateRef, k: int) -> list[KVStateRef]:
    """``k`` copy-on-write children of the state."""
    return _runtime_for_state(state, None).fork(state, k)


def merge(*states: KVStateRef, policy: str = "concat") -> KVStateRef:
    """Restricted composition of states (see ``kvs.merge``)."""
    rt = _runtime_for_state(states[0], None) if states and isinstance(states[0], KVStateRef) else runtime()
    return rt.merge(states, policy)


def estimate(state: KVStateRef) -> dict:
    """The transfer-versus-recompute rule's view of ``state`` on this worker (nothing moves)."""
    return _runtime_for_state(state, None).estimate(_check_state(state))


def measure_fill(state: KVStateRef, action: str) -> float:
    """Seconds to pull or recompute all of ``state``'s blocks on this worker (benchmarks)."""
    return _runtime_for_state(state, None).measure_fill(_check_state(state), action)


def measure_raw_fetch(key: str, holder: str) -> float:
    """Seconds for this worker to fetch task result ``key`` from ``holder`` the way Dask
    moves any data (``get_data``): the baseline KV pulls are measured against."""
    from distributed.worker import get_data_from_worker

    worker = get_worker()
    t0 = time.perf_counter()
    resp = sync(worker.loop, get_data_from_worker, worker.rpc, [key], holder, who=worker.address)
    seconds = time.perf_counter() - t0
    if key not in resp.get("data", {}):
        raise RuntimeError(f"{holder} did not return {key!r}: {resp.get('status')}")
    return seconds


def transfer(state: KVStateRef) -> KVStateRef:
    """Make the worker running this task the state's holder."""
    return _runtime_for_state(state, None).transfer(state)


def evict(state: KVStateRef) -> int:
    """Free the state's blocks here and on its holder; returns the bytes freed.

    Blocks still used by another live state (a fork, an extension) stay. A holder
    that is gone is skipped: its blocks went with it.
    """
    from distributed.protocol import to_serialize

    from dask_kvstate.plugins.worker.plugin import PLUGIN_NAME
    from dask_kvstate.plugins.worker.transport import call

    rt = _runtime_for_state(state, None)
    freed = rt.worker.plugins[PLUGIN_NAME].evict(state)
    holder = state.placement.worker
    if holder and holder != rt.address:
        with contextlib.suppress(OSError, TimeoutError):  # a holder that is gone took its blocks along
            freed += sync(
                rt.worker.loop,
                call,
                rt.worker.rpc,
                holder,
                "kvstate_evict",
                state=to_serialize(state),
                connect_timeout=rt.settings.connect_timeout,
                timeout=rt.settings.pull_timeout,
            )
    return freed
