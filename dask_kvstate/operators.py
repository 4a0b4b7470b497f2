"""The stateflow operators as ``dask.delayed`` builders (the public API).

Each call adds one task to a graph and returns a ``Delayed``; arguments may be
literals or other ``Delayed`` objects (a document retrieved by an upstream task, a
state from ``materialize``). Keys are deterministic, ``kvs-<op>-<token>``, so the same
call twice is one task, except sampling without a seed, which is never deduplicated.
Everything runs where Dask places it; refs are small, the blocks stay on workers.

Every setting of a call is fixed here, from this client's ``dask.config``, when the graph
is built, never on the worker or the scheduler: the namespace (tenant, ``kvstate.namespace``),
and for the generating calls every decode option (``kvstate.generate.max-new-tokens``,
``temperature``, ``top-p``; :func:`~dask_kvstate.generation.fixed_options`) and, for
``generate``, the prefix-cache choice (``kvstate.generate.prefix-cache``). They are
arguments of the task, so they are in its key: equal calls of two tenants, or of two
temperatures, are two tasks, a sampled call without a seed gets a key of its own (its
temperature known here, not filled in later by a worker), and the compiler copies them
from there into the tasks it inserts. New blocks (``materialize``, the prefix cache of
``generate``) are hashed with the namespace; an operator on a state keeps the state's
own namespace for its blocks.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import dask
from dask.base import tokenize
from dask.delayed import Delayed

from dask_kvstate import config, tasks
from dask_kvstate.generation import DecodeOptions, fixed_options

if TYPE_CHECKING:
    from typing import Unpack


def _task(
    func, *args, nout: int | None = None, unique: bool = False, namespace: str | None = None, **kwargs
) -> Delayed:
    op = func.__name__
    kwargs["namespace"] = namespace or config.get("namespace")
    token = tokenize(op, args, kwargs, uuid.uuid4().hex if unique else None)
    return dask.delayed(func, pure=True, nout=nout)(*args, dask_key_name=f"kvs-{op}-{token}", **kwargs)


def _decode(options: Mapping[str, Any], call: str) -> dict[str, Any]:
    """The task's keywords: every decode option as it will run (this client's defaults filled
    in), and ``unique`` for sampling without a seed, which must never be deduplicated."""
    opts = fixed_options(options, call)
    return {**opts, "unique": opts["temperature"] > 0 and opts["seed"] is None}


def materialize(*segments, namespace: str | None = None, model: str | None = None) -> Delayed:
    """Prefill the prompt ``"".join(segments)`` once and return its state.

    Returns ``Delayed[KVStateRef]``. Leading tokens already stored on the worker (same
    tokens, same model, same namespace), in whole blocks and in the block where the text
    parts from a stored one, are reused, not recomputed. ``namespace``
    defaults to ``kvstate.namespace`` on this client. ``model`` picks one of the models
    given to ``kvs.install`` (default: the first); calls on a state use the state's model
    unless told otherwise.

    Examples
    --------
    >>> import dask_kvstate as kvs
    >>> ctx = kvs.materialize("You are a careful planner. ", "Task: ship it.")
    >>> ctx.key.startswith("kvs-materialize-")
    True
    """
    return _task(tasks.materialize, *segments, namespace=namespace, model=model)


def fork(state, k: int) -> list[Delayed]:
    """``k`` copy-on-write children of ``state``: O(1), the blocks are shared.

    Examples
    --------
    >>> import dask_kvstate as kvs
    >>> len(kvs.fork(kvs.materialize("shared context"), 4))
    4
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(
            f"fork needs a positive int k, got {k!r}: k is the number of branches "
            "(kvs.fork(state, 3) gives 3 states); use k >= 1"
        )
    return list(_task(tasks.fork, state, k, nout=k))


def extend(state, *segments, model: str | None = None) -> Delayed:
    """``state`` followed by more text: ``Delayed[KVStateRef]``.

    The result is exactly the state of ``state.text + "".join(segments)``: the joined
    text is re-tokenized and only the tokens after the common prefix are prefilled.
    """
    return _task(tasks.extend, state, *segments, model=model)


def resume(state, *segments, **options: Unpack[DecodeOptions]) -> Delayed:
    """Generate from ``state`` followed by ``segments``: ``Delayed[Generation]`` (a str).

    Token-identical to ``generate(state.text, *segments)`` (greedy, or sampling with
    the same seed); the state's KV replaces the prefill of its tokens. ``options``:
    ``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ``model``
    (:class:`~dask_kvstate.generation.DecodeOptions`; defaults from this client's
    ``kvstate.generate.*``, read now). Raises ValueError naming a bad option.
    """
    return _task(tasks.resume, state, *segments, **_decode(options, "resume"))


def generate(
    *segments, prefix_cache: bool | None = None, namespace: str | None = None, **options: Unpack[DecodeOptions]
) -> Delayed:
    """Generate from the prompt ``"".join(segments)`` by text replay: ``Delayed[Generation]``.

    ``prefix_cache=True`` (default ``kvstate.generate.prefix-cache`` here) reuses prompt
    blocks already in the running worker's store and leaves its own there: automatic
    prefix caching inside one worker, as vLLM/SGLang do inside one engine (no transfer
    between workers, no compiler), only ever blocks of the call's ``namespace``
    (default ``kvstate.namespace`` here). Output is the same either way.

    Examples
    --------
    >>> import dask_kvstate as kvs
    >>> answer = kvs.generate("Question: what is 2 + 2? Answer:", max_new_tokens=8)
    >>> answer.key.startswith("kvs-generate-")
    True
    """
    cached = bool(config.get("generate.prefix-cache") if prefix_cache is None else prefix_cache)
    return _task(tasks.generate, *segments, namespace=namespace, prefix_cache=cached, **_decode(options, "generate"))


def merge(*states, policy: str = "concat") -> Delayed:
    """Restricted composition: ``Delayed[KVStateRef]``.

    Only ``policy="concat"``: sequential, non-overlapping, prefix-compatible states,
    each continuing the previous one (as ``extend`` builds them); the result equals a
    prefill of the concatenated tokens. Anything else (diverging branches,
    independently prefilled segments, other models) raises ``MergeError`` (a
    ``ValueError``) when computed, naming the two states and why.
    """
    if policy != "concat":
        raise ValueError(f"unknown merge policy {policy!r}; supported: 'concat'")
    if not states:
        raise ValueError("merge needs at least one state")
    return _task(tasks.merge, *states, policy=policy)


def transfer(state, worker: str) -> Delayed:
    """Make ``worker`` (an address) hold ``state``'s blocks: ``Delayed[KVStateRef]``."""
    if not isinstance(worker, str) or not worker:
        raise ValueError(f"transfer needs a worker address, got {worker!r}")
    with dask.annotate(workers=[worker], allow_other_workers=False):
        return _task(tasks.transfer, state, unique=True)


def evict(state) -> Delayed:
    """Release ``state``'s blocks on its holder (and here): ``Delayed[int]`` bytes freed.

    Blocks shared with other live states stay. Using ``state`` afterwards still
    works: its blocks are recomputed from its text.
    """
    return _task(tasks.evict, state, unique=True)


def resume_many(state, suffixes, **options: Unpack[DecodeOptions]) -> list[Delayed]:
    """Sibling resumes from one state, decoded together: one ``Delayed[Generation]`` per suffix.

    Each result equals ``resume(state, suffix)`` token for token; the siblings run as
    one task whose decode steps are batched, which on CPU costs far less than one
    decode per sibling. ``kvs.stateflow()`` emits this for siblings of one fork
    (``kvstate.compiler.batch-siblings``).

    Examples
    --------
    >>> import dask_kvstate as kvs
    >>> outs = kvs.resume_many(kvs.materialize("shared context"), ["Q1?", "Q2?"], max_new_tokens=8)
    >>> len(outs)
    2
    """
    suffixes = list(suffixes)
    if not suffixes:
        raise ValueError("resume_many needs at least one suffix")
    batch = _task(tasks.resume_many, state, suffixes, nout=len(suffixes), **_decode(options, "resume_many"))
    return list(batch)
