"""The ``sessions`` scheduler extension: the workflow context Nalar's policies read.

Per session (``kvs.session``) it keeps invocations created and completed (progress),
arrival time and order, liveness (open, closed, ended) and visits per component. It
also owns the global control loop the other scheduling extensions register with, and
the worker handshake (its answer to :data:`~dask_kvstate.protocol.HELLO`) telling which
workers run the ``kvstate-scheduling`` worker plugin, so no extension ever sends a stream message a
worker cannot handle (Dask drops the stream of a worker on an unknown op).

**End hook.** A session ends once its ``with`` block has exited and the scheduler
holds none of its tasks. Then every callable in ``SessionTracker.on_end`` is called
with the :class:`Session` (``scheduler.plugins["kvstate-sessions"].on_end.append(fn)``;
the KV lifecycle extension invalidates the session's KV there), and an
``{"kind": "end", ...}`` event goes to the ``kvstate-session`` topic, so clients can
``client.subscribe_topic`` to it. A failing hook is logged, never raised.

**What ends a session.** Three things close one, and each takes the same path to its
end (its tasks gone, then the end hooks, which release its KV on every worker):

* its ``with`` block's exit (the client's close notice);
* its client leaving the cluster (:meth:`SessionTracker.remove_client`: a client that
  was killed, or lost its connection, sends no notice). A session's client is the one
  whose graph brought its first task (``Session.owner``); Dask has released that client's
  futures just before, so the session ends one control interval later unless another
  client still holds its tasks;
* no activity for ``kvstate.scheduling.sessions.idle-timeout`` (off by default): none of
  its tasks waiting, running or finishing for that long. Futures its client still holds
  do not keep it open (they keep their own refs' blocks, not the session's), so this
  ends it at once and its remaining tasks leave it.

``Session.reason`` says which (``"closed"``, ``"client-gone"``, ``"idle"``).

**An end is final.** The ids of ended sessions are remembered (the last
:data:`ENDED_IDS_KEPT`): a graph that arrives later under one of them (a ``Delayed``
built in the session and computed after its end) does not bring it back; its tasks
belong to no session, and lose the annotation before any worker sees them, so no
worker holds KV for a session that has ended.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from time import time
from typing import TYPE_CHECKING

from distributed.diagnostics.plugin import SchedulerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler

from dask_kvstate import config
from dask_kvstate.plugins.scheduler.control import ControlLoop
from dask_kvstate.plugins.scheduler.handshake import AnnouncedWorkers, serve_hello
from dask_kvstate.plugins.scheduler.patches import PATCHES, SESSIONS, UPDATE_GRAPH
from dask_kvstate.protocol import (
    SCHEDULING_WORKER_PLUGIN,
    SESSION_ANNOTATION,
    SESSION_TOPIC,
    SESSIONS_EXTENSION,
)
from dask_kvstate.session import component_of

logger = logging.getLogger("dask_kvstate")

ENDED_KEPT = 1000  # summaries of ended sessions kept for stats
ENDED_IDS_KEPT = 100_000  # ids of ended sessions remembered, so a late graph cannot revive one


@dataclass(eq=False)
class Session:
    """What the scheduler knows of one workflow request."""

    id: str
    seq: int  # arrival order on this scheduler
    arrival: float
    created: int = 0
    completed: int = 0
    failed: int = 0
    visits: Counter = field(default_factory=Counter)  # component -> invocations created
    live: set = field(default_factory=set)  # keys the scheduler still holds
    closed_at: float | None = None
    closed_by: str | None = None  # the client whose notice closed it, when the notice names it
    ended_at: float | None = None
    last_activity: float = 0.0
    owner: str | None = None  # the client whose graph brought its first task
    reason: str | None = None  # what closed or ended it: "closed" (its notice), "client-gone" or "idle"

    @property
    def progress(self) -> int:
        """Completed invocations: Nalar's measure of workflow progress."""
        return self.completed

    def summary(self) -> dict:
        return {
            "id": self.id,
            "seq": self.seq,
            "arrival": self.arrival,
            "created": self.created,
            "completed": self.completed,
            "failed": self.failed,
            "visits": dict(self.visits),
            "live": len(self.live),
            "closed_at": self.closed_at,
            "ended_at": self.ended_at,
            "owner": self.owner,
            "reason": self.reason,
        }


class SessionTracker(AnnouncedWorkers, SchedulerPlugin):
    """Scheduler side of ``kvs.session`` (installed by ``kvs.install`` when enabled)."""

    scheduler: Scheduler  # set by start()

    name = SESSIONS_EXTENSION
    worker_half = SCHEDULING_WORKER_PLUGIN
    idempotent = True

    def __init__(self, interval: str | float | None = None, idle_timeout: str | float | None = None):
        self.interval_s = config.get_seconds("scheduling.interval", interval)
        key = "scheduling.sessions.idle-timeout"
        self.idle_s = config.parse(key, config.get(key) if idle_timeout is None else idle_timeout)

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.sessions: dict[str, Session] = {}
        self.key_session: dict = {}  # key -> Session
        self.closing: set[Session] = set()  # closed, waiting for their tasks to go
        self.ended: deque = deque(maxlen=ENDED_KEPT)
        self.ended_ids: dict[str, None] = {}  # oldest first
        self.on_end: list = []
        self.announced: set[str] = set()  # workers running the kvstate-scheduling plugin
        self.counters: Counter[str] = Counter()
        self.arriving: Counter[str] = Counter()  # session -> its graphs the scheduler is still building
        self.building: Counter[str] = Counter()  # client -> its graphs the scheduler is still building
        self._seq = 0
        self.loop = ControlLoop(self.interval_s)
        self.loop.add("sessions", self.sweep)
        serve_hello(scheduler)
        # Dask's SchedulerPlugin.update_graph does not receive ``submitting_task``, the
        # key of the task that submitted a graph from inside a worker: the stream handler
        # is wrapped to read it, so sub-tasks inherit their parent's session.
        PATCHES.install(scheduler, SESSIONS, {UPDATE_GRAPH: self._wrap_update_graph}, owner=self)
        self.loop.start()

    async def close(self) -> None:
        self.loop.stop()
        if hasattr(self, "scheduler"):
            PATCHES.remove(self.scheduler, SESSIONS, owner=self)

    def _wrap_update_graph(self, original):
        """``original`` (the ``update-graph`` stream handler), reading ``submitting_task``."""

        async def update_graph(*args, submitting_task=None, annotations=None, **kwargs):
            parent = self.key_session.get(submitting_task) if submitting_task is not None else None
            if parent is not None and SESSION_ANNOTATION not in (annotations or {}):
                annotations = {**(annotations or {}), SESSION_ANNOTATION: parent.id}
                self.counters["inherited_graphs"] += 1
            # A graph is built (deserialized, materialized, compiled) off the event loop,
            # which takes a while on a busy scheduler: neither its session may end
            # meanwhile, nor one its client closed, whose last graphs may wait unread on
            # the same stream behind this one (the stream's graphs are built in turn).
            sid = (annotations or {}).get(SESSION_ANNOTATION)
            sid = sid if isinstance(sid, str) else None
            client = kwargs.get("client")
            for counter, name in ((self.arriving, sid), (self.building, client)):
                if name is not None:
                    counter[name] += 1
            try:
                return await original(*args, submitting_task=submitting_task, annotations=annotations, **kwargs)
            finally:
                for counter, name in ((self.arriving, sid), (self.building, client)):
                    if name is not None:
                        counter[name] -= 1
                        if counter[name] <= 0:
                            del counter[name]

        return update_graph

    # -- Dask hooks ----------------------------------------------------------------
    def update_graph(self, scheduler, *, tasks=(), annotations=None, client=None, **kwargs) -> None:
        by_key = (annotations or {}).get(SESSION_ANNOTATION) or {}
        if not by_key:
            return
        now = time()
        for key, sid in by_key.items():
            if key in self.key_session:
                continue
            ts = scheduler.tasks.get(key)
            if ts is None or ts.run_spec is None:
                continue  # not a task to run (scattered data, an already-forgotten key)
            if sid in self.ended_ids:
                # Before the first transition: the task reaches its worker without the session.
                self.counters["late_tasks"] += 1
                if ts.annotations:
                    ts.annotations.pop(SESSION_ANNOTATION, None)
                continue
            s = self.sessions.get(sid)
            if s is None:
                self._seq += 1
                s = self.sessions[sid] = Session(sid, self._seq, now, owner=client)
                scheduler.log_event(SESSION_TOPIC, {"kind": "start", "session": sid, "seq": s.seq})
            elif s.owner is None:  # opened by a close notice that overtook its first graph
                s.owner = client
            s.created += 1
            s.visits[component_of(ts)] += 1
            s.live.add(key)
            s.last_activity = now
            self.key_session[key] = s

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        s = self.key_session.get(key)
        if s is None:
            return
        if finish == "memory" and start == "processing":
            s.completed += 1
            s.last_activity = time()
        elif finish == "erred":
            s.failed += 1
            s.last_activity = time()
        elif finish == "forgotten":
            del self.key_session[key]
            s.live.discard(key)

    def log_event(self, topic, msg) -> None:
        if topic == SESSION_TOPIC and isinstance(msg, dict) and msg.get("kind") == "close":
            if msg.get("session") in self.ended_ids:
                return  # a repeated notice of a session that has ended
            s = self.sessions.get(msg["session"]) if "session" in msg else None
            if s is None:  # a session that submitted nothing: it starts and ends here
                self._seq += 1
                now = time()
                s = self.sessions[msg["session"]] = Session(msg["session"], self._seq, now, last_activity=now)
            self._close(s, msg.get("client"), "closed")

    def remove_client(self, scheduler, client: str) -> None:
        """``client`` left (closed, killed, or cut off): close every session it opened and did not close.

        Its futures are released by now, so each ends like a closed one: once the
        scheduler holds none of its tasks, a control interval on.
        """
        gone = [s for s in self.sessions.values() if s.owner == client and s.closed_at is None]
        for s in gone:
            self._close(s, client, "client-gone")
        if gone:
            self.counters["closed_by_client_removal"] += len(gone)
            logger.info("kvstate sessions: client %s left with %d open session(s); closing them", client, len(gone))

    def _close(self, s: Session, by: str | None, reason: str) -> None:
        if s.closed_at is None:
            s.closed_at = time()
            s.closed_by = by
            s.reason = reason
            self.closing.add(s)

    # -- the control pass ------------------------------------------------------------
    def sweep(self) -> None:
        """End closed sessions whose tasks are all gone.

        The close notice travels by RPC while the session's last graphs travel on the
        client's batched stream, so it can overtake them: by a few milliseconds on the
        wire (one interval of grace after the notice covers that), and by as long as the
        scheduler takes to build the graphs ahead of them on that stream (a session does
        not end while one of its graphs, or one of the closing client's, is being built).
        """
        now = time()
        for s in [
            s
            for s in self.closing
            if not s.live
            and s.id not in self.arriving
            and (s.closed_by is None or s.closed_by not in self.building)
            and now - (s.closed_at or now) >= self.interval_s
        ]:
            self.closing.discard(s)
            self._end(s, now)
        if self.idle_s is not None:
            self._end_idle(now, self.idle_s)

    def _end_idle(self, now: float, idle_s: float) -> None:
        """End every session none of whose tasks has waited, run or finished for ``idle_s``.

        The cheap test (the time of its last activity) goes first, so a pass reads the
        task states only of sessions already that quiet. Its close notice counts as
        activity, and the limit is at least one control interval: the grace a notice gets
        against the session's graphs still on the wire.
        """
        limit = max(idle_s, self.interval_s)
        quiet = [s for s in self.sessions.values() if now - max(s.last_activity, s.arrival, s.closed_at or 0) >= limit]
        for s in quiet:
            if s.id in self.arriving or (s.owner is not None and s.owner in self.building):
                continue  # a graph of it, or maybe of it, is on its way in
            if any(self._busy(key) for key in s.live):
                continue
            s.reason = "idle"  # closed or not: the quiet is what ends it
            for key in s.live:  # what it still holds leaves it: a late task of an ended session holds nothing
                self.key_session.pop(key, None)
            s.live.clear()
            self.closing.discard(s)
            self.counters["ended_idle"] += 1
            self._end(s, now)

    def _busy(self, key) -> bool:
        ts = self.scheduler.tasks.get(key)
        return ts is not None and ts.state in ("waiting", "queued", "no-worker", "processing")

    def _end(self, s: Session, now: float) -> None:
        s.ended_at = now
        del self.sessions[s.id]
        self.ended_ids[s.id] = None
        while len(self.ended_ids) > ENDED_IDS_KEPT:
            self.ended_ids.pop(next(iter(self.ended_ids)))
        self.ended.append(s.summary())
        self.counters["ended"] += 1
        for fn in list(self.on_end):
            try:
                fn(s)
            except Exception:
                logger.exception("kvstate session end hook %r failed for %s", fn, s.id)
        self.scheduler.log_event(SESSION_TOPIC, {"kind": "end", **s.summary()})

    # -- reads ---------------------------------------------------------------------
    def session_of(self, key) -> Session | None:
        return self.key_session.get(key)

    def progress(self) -> dict:
        """Live sessions' progress, ``{id: {"done": completed, "total": created}}``: the
        dashboard's sessions panel reads this."""
        return {
            sid: {"done": s.completed, "total": s.created, "closed": s.closed_at is not None}
            for sid, s in list(self.sessions.items())[:100]
        }

    def stats(self) -> dict:
        return {
            "open": sum(s.closed_at is None for s in self.sessions.values()),
            "closing": len(self.closing),
            "ended": self.counters["ended"],
            "ended_idle": self.counters["ended_idle"],
            "closed_by_client_removal": self.counters["closed_by_client_removal"],
            "idle_timeout": self.idle_s,
            "inherited_graphs": self.counters["inherited_graphs"],
            "late_tasks": self.counters["late_tasks"],
            "workers": len(self.announced),
            "sessions": {sid: s.summary() for sid, s in list(self.sessions.items())[:100]},
            "recently_ended": list(self.ended)[-100:],
            "control_loop": self.loop.stats(),
        }
