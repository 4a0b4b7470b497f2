"""Copies of ref-holding task results, carried by the scheduler: the worker side.

A task that makes a KV state returns a :class:`~dask_kvstate.state.KVStateRef` (a fork a
list of them): a few hundred bytes. A consumer on another worker needs that value before
its task can start, and Dask fetches it from the holder (``gather_dep``) with Dask's comm
connect timeout, 30 s by default. A holder whose link went down thus held every consumer
30 s before the transfer-or-recompute rule ran, whose own pull gives a holder
``transport.connect-timeout`` and then recomputes.

So the holder sends the value, as rows of plain values (:meth:`KVStateRef.to_row`), with
the ref report it sends the placement extension anyway (:func:`pack`), and the extension
hands a copy to each worker a dependent task is sent to, just ahead of the task on the
same stream (:mod:`dask_kvstate.plugins.scheduler.ref_relay`). :func:`receive` puts it
in the worker's memory the way Dask's own scatter does and tells the scheduler, as a
finished fetch would (``add-keys``): the task finds its input here, and nothing dials
the holder until the KV rule pulls blocks.
"""

from __future__ import annotations

import contextlib
import logging
from time import time

import msgpack
from distributed.comm.core import CommClosedError

from dask_kvstate.protocol import REF_COPY, WORKER_PLUGIN
from dask_kvstate.state import KVStateRef, refs_in

logger = logging.getLogger("dask_kvstate")

#: the containers a copy rebuilds exactly (a fork's result is a list)
KINDS = {"ref": None, "list": list, "tuple": tuple}
#: worker task states a copy may replace: not here yet, or still being fetched
TAKES_A_COPY = (None, "released", "fetch", "flight", "missing")


def pack(value, limit: int) -> dict | None:
    """``value`` (a ref, or a plain list or tuple of refs) as a message part of at most
    ``limit`` bytes; None for any other value, a larger one, or ``limit`` 0.

    Examples
    --------
    >>> from dask_kvstate.state import example_ref
    >>> ref = example_ref()
    >>> copy = pack([ref, ref], 64 * 1024)
    >>> copy["kind"], unpack(copy) == [ref, ref]
    ('list', True)
    >>> pack(ref, 10), pack("text", 1024), pack(ref, 0)
    (None, None, None)
    """
    refs = refs_in(value)
    kind = "ref" if isinstance(value, KVStateRef) else type(value).__name__
    if limit <= 0 or not refs or kind not in KINDS:
        return None
    rows = [r.to_row() for r in refs]
    if len(msgpack.packb(rows, use_bin_type=True)) > limit:
        return None
    return {"kind": kind, "rows": rows}


def unpack(copy) -> KVStateRef | list | tuple:
    """The value :func:`pack` made ``copy`` of; ValueError naming what is wrong otherwise.

    >>> unpack({"kind": "set", "rows": []})
    Traceback (most recent call last):
    ...
    ValueError: malformed ref copy: kind 'set', rows of type list
    """
    kind, rows = (copy.get("kind"), copy.get("rows")) if isinstance(copy, dict) else (None, None)
    if kind not in KINDS or not isinstance(rows, (list, tuple)) or not rows or (kind == "ref" and len(rows) != 1):
        raise ValueError(f"malformed ref copy: kind {kind!r}, rows of type {type(rows).__name__}")
    refs = [KVStateRef.from_row(r) for r in rows]
    container = KINDS[kind]
    return refs[0] if container is None else container(refs)


def serve(worker) -> None:
    """Handle :data:`REF_COPY` on ``worker``'s stream from the scheduler (idempotent).

    The handler stays when the plugin goes: the scheduler may still send a copy, and a
    stream op with no handler would close the worker's stream.
    """
    worker.stream_handlers[REF_COPY] = lambda key=None, copy=None, **_: receive(worker, key, copy)


def receive(worker, key, copy) -> bool:
    """Put the copy of ``key``'s value in ``worker``'s memory; whether it was taken.

    Taken only where the worker does not have the key in memory already, nor runs it
    itself. Never raises: a copy that cannot be read is dropped (logged), and the
    worker fetches the key from its holder as Dask always does.
    """
    from distributed.worker_state_machine import UpdateDataEvent

    try:
        value = unpack(copy)
    except ValueError as e:
        logger.warning("kvstate: dropping the scheduler's copy of %r (%s); fetching it from its holder", key, e)
        return False
    ts = worker.state.tasks.get(key)
    if (ts.state if ts is not None else None) not in TAKES_A_COPY:
        return False
    stimulus_id = f"kvstate-ref-copy-{time()}"
    worker.handle_stimulus(UpdateDataEvent(data={key: value}, stimulus_id=stimulus_id))
    ts = worker.state.tasks.get(key)
    if ts is None or ts.state != "memory":
        return False
    # A scattered value reaches memory unannounced (the scatterer tells the scheduler
    # itself); this one is announced as a fetched one is, so the scheduler counts the replica.
    with contextlib.suppress(CommClosedError):  # a closed stream: the next scheduler learns it at registration
        worker.batched_stream.send({"op": "add-keys", "keys": [key], "stimulus_id": stimulus_id})
    plugin = worker.plugins.get(WORKER_PLUGIN)
    runtime = getattr(plugin, "runtime", None)
    if runtime is not None:
        runtime.counters["ref_copies"] += 1
    return True
