"""Workflow sessions (Nalar): one user request, the unit of progress and liveness.

A session is a Dask annotation, ``kvstate-session``, so it rides on what Dask already
carries to the scheduler: ``dask.annotate`` reaches both ``dask.delayed`` graphs and
``client.submit`` (``Client._graph_to_futures`` merges ``dask.get_annotations()`` into
every graph it sends). Tasks submitted from inside a task (``worker_client`` /
``get_client``) run in a worker thread where no annotation context is set; the
scheduler's session tracker gives them the session of the task that submitted them
(the ``submitting_task`` Dask sends with every graph), so nothing is needed here.

The context's exit is told to the scheduler with ``Client.log_event`` on the
``kvstate-session`` topic (a public, fire-and-forget path into scheduler plugins). The
session ends when that notice has arrived and the scheduler holds none of its tasks
any more (every future released); ending fires the tracker's end hooks. A client that
never sends the notice (killed inside the block) closes its sessions by leaving: the
scheduler's session tracker hears the client's removal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import dask
from dask.utils import key_split

from dask_kvstate.protocol import COMPONENT_ANNOTATION, SESSION_ANNOTATION, SESSION_TOPIC

logger = logging.getLogger("dask_kvstate")


@dataclass(frozen=True)
class SessionHandle:
    """What ``with kvs.session() as s`` yields: the id on every task and the name."""

    id: str
    name: str


def new_session_id(name: str | None = None) -> str:
    """A unique id that keeps the readable name in front.

    Examples
    --------
    >>> new_session_id("triage").startswith("triage-")
    True
    >>> new_session_id() != new_session_id()
    True
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"session name must be a str or None, got {type(name).__name__}: {name!r}")
    return f"{name or 'session'}-{uuid.uuid4().hex[:12]}"


def current_session() -> str | None:
    """The session id the caller's tasks get now, or None outside any session."""
    return dask.get_annotations().get(SESSION_ANNOTATION)


def _client_or_none():
    from distributed import get_client

    try:
        return get_client()  # inside a task: the worker's client
    except ValueError:
        return None


_PENDING: set = set()


def _notify_close(session_id: str, client=None) -> None:
    client = client if client is not None else _client_or_none()
    if client is None or client.status not in ("running", "connecting", "newly-created"):
        return  # no cluster to tell: the scheduler never saw the session's tasks either
    # The client's id lets the scheduler wait for graphs of its still queued on its stream.
    msg = {"kind": "close", "session": session_id, "client": client.id}
    if client.asynchronous:
        # Called from a coroutine: the notice must not block the event loop it runs on.
        task = asyncio.ensure_future(client.log_event(SESSION_TOPIC, msg))
        _PENDING.add(task)  # a reference until done: the loop keeps only a weak one
        task.add_done_callback(_PENDING.discard)
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        client.log_event(SESSION_TOPIC, msg)
    else:  # a blocking client inside someone's event loop would deadlock or cross loops
        raise RuntimeError(
            f"session {session_id}: found a synchronous client inside a running event loop; "
            "pass the asynchronous one: kvs.session(name, client=client)"
        )


@contextlib.contextmanager
def session(name: str | None = None, client=None) -> Iterator[SessionHandle]:
    """Mark every task submitted inside the block as one workflow request.

    The scheduler extensions use it for workflow-progress priority, session affinity of
    stateful components, visits per request (capacity) and, when the session ends, to
    invalidate what it left behind. Nested sessions: the innermost wins. Works without a
    cluster (the annotation is simply carried); the exit notice never raises (a failed
    notice is logged: that session then ends when its client leaves the cluster, or after
    ``kvstate.scheduling.sessions.idle-timeout`` without activity). ``client`` is the
    one to tell at exit; by default ``distributed.get_client()`` (inside a task: the
    worker's client). Pass it where several clients live in one process.

    Examples
    --------
    >>> import dask, dask_kvstate as kvs
    >>> with kvs.session("review") as s:
    ...     x = dask.delayed(sum)([1, 2])
    ...     kvs.current_session() == s.id
    True
    >>> kvs.current_session() is None
    True
    """
    handle = SessionHandle(new_session_id(name), name or "session")
    with dask.annotate(**{SESSION_ANNOTATION: handle.id}):
        try:
            yield handle
        finally:
            try:
                _notify_close(handle.id, client)
            except Exception as e:  # a closing cluster must not mask the block's own error
                logger.warning("kvstate: could not tell the scheduler that %s ended: %s", handle.id, e)


def component_of(ts) -> str:
    """A task's component: its ``kvstate-component`` annotation, else its key's prefix.

    ``ts`` is a scheduler's or a worker's ``TaskState`` (both carry the annotations),
    so the scheduler's extensions and the worker's batching agree on what a component is.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> component_of(SimpleNamespace(key="triage-0a1b2c3d", annotations=None))
    'triage'
    >>> component_of(SimpleNamespace(key="triage-0a1b2c3d", annotations={"kvstate-component": "tester"}))
    'tester'
    """
    return (ts.annotations or {}).get(COMPONENT_ANNOTATION) or key_split(ts.key)


def component(name: str):
    """Name the component (agent or tool) of the tasks built inside, for hints and visits.

    Without it the component is the task's key prefix (the function name).

    Examples
    --------
    >>> import dask, dask_kvstate as kvs
    >>> with kvs.component("tester"):
    ...     dask.get_annotations()["kvstate-component"]
    'tester'
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"component name must be a non-empty str, got {name!r}")
    return dask.annotate(**{COMPONENT_ANNOTATION: name})
