"""The ``observe`` scheduler extension: what the scheduler knows about KV state, for people.

The dashboard page must never block the scheduler's event loop on ``client.run``, so
workers push instead, over the batched stream they already keep open:

* ``kvstate-stats``: the worker's ``kvs.stats`` entry, sent every
  ``kvstate.dashboard.report-interval`` when it changed (one dict compare when idle);
* ``kvstate-states``: the states a task just computed there (id, op, parents, tokens,
  bytes), for the lineage of the largest states.

The extension keeps the latest stats per worker, a bounded history of cluster totals
(sampled every ``kvstate.dashboard.refresh-interval``, so a page opened late still
shows the run so far) and a bounded map of state summaries. From successive stats it
logs the block store's spills, unspills and drops under ``kvstate-store``, one
event per worker and interval with counts, instead of one per block.

It serves the ``/kvstate`` page (:mod:`dask_kvstate.plugins.scheduler.dashboard`) when the
scheduler runs a dashboard and Bokeh is importable. ``kvstate.dashboard.enabled`` switches
the extension, page and all.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from distributed.diagnostics.plugin import SchedulerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler
from distributed.metrics import time
from tornado.ioloop import PeriodicCallback

from dask_kvstate import config
from dask_kvstate.plugins.scheduler.handshake import serve_hello
from dask_kvstate.protocol import OBSERVE_EXTENSION, SESSIONS_EXTENSION, STATES, STATS, STORE_TOPIC
from dask_kvstate.views import TIERS, totals

logger = logging.getLogger("dask_kvstate")

#: State summaries kept for lineage walks, live or not (parents are often forgotten early).
MAX_STATES = 4096


class KVObserver(SchedulerPlugin):
    """Scheduler side of kvstate observability (installed by ``kvs.install``)."""

    scheduler: Scheduler  # set by start()

    name = OBSERVE_EXTENSION
    idempotent = True

    def __init__(self):
        self.refresh_s = config.get_seconds("dashboard.refresh-interval")
        self.report_s = config.get_seconds("dashboard.report-interval")
        self.history_len = int(config.get("dashboard.history"))
        self.largest_n = int(config.get("dashboard.largest-states"))
        if self.history_len < 1 or self.largest_n < 0:
            raise ValueError(
                f"kvstate.dashboard.history must be >= 1 and largest-states >= 0, got "
                f"{self.history_len!r} and {self.largest_n!r}"
            )

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.stats: dict[str, dict] = {}  # worker -> its latest kvs.stats entry
        self.history: deque[tuple[float, dict]] = deque(maxlen=self.history_len)
        self.states: OrderedDict[str, dict] = OrderedDict()  # state id -> summary
        self.live: dict = {}  # key -> state ids its value holds
        serve_hello(scheduler)
        scheduler.stream_handlers.update({STATS: self._on_stats, STATES: self._on_states})
        self._sampler = PeriodicCallback(self.sample, self.refresh_s * 1000)
        self._sampler.start()
        # kvstate.dashboard.enabled decides whether this extension is installed at all.
        from dask_kvstate.plugins.scheduler.dashboard import register_page

        self._app = register_page(scheduler, self)

    async def close(self) -> None:
        if getattr(self, "_sampler", None) is not None:
            self._sampler.stop()
        if getattr(self, "_app", None) is not None:
            from dask_kvstate.plugins.scheduler.dashboard import unregister_page

            unregister_page(self.scheduler, self._app)

    def kvstate_hello(self, worker: str | None, plugin: str | None) -> dict:
        """Present: workers push their stats this often (the client's setting, carried here)."""
        return {"interval": self.report_s}  # the client's setting, carried by this plugin

    # -- reports from workers ------------------------------------------------------
    def _on_stats(self, worker=None, stats=None, **_) -> None:
        if worker not in self.scheduler.workers or not stats:
            return
        prev = self.stats.get(worker)
        self.stats[worker] = stats
        if prev is not None:
            self._log_store_changes(worker, prev, stats)

    def _log_store_changes(self, worker: str, prev: dict, now: dict) -> None:
        """One ``kvstate-store`` event for what the store moved since the last report."""
        moved = {}
        for tier in TIERS:
            for what in ("spills", "unspills"):
                d = now.get("tiers", {}).get(tier, {}).get(what, 0) - prev.get("tiers", {}).get(tier, {}).get(what, 0)
                if d > 0:
                    moved[f"{tier}_{what}"] = d
        dropped = now.get("dropped", 0) - prev.get("dropped", 0)
        if dropped > 0:
            moved["dropped"] = dropped
        if moved:
            self.scheduler.log_event(STORE_TOPIC, {"kind": "store", "worker": worker, **moved})

    def _on_states(self, worker=None, key=None, states=(), **_) -> None:
        for s in states:
            self.states[s["state"]] = {**s, "key": key, "holder": worker}
            self.states.move_to_end(s["state"])
        while len(self.states) > MAX_STATES:
            self.states.popitem(last=False)
        ts = self.scheduler.tasks.get(key)
        # The report may come before or after the scheduler hears the task finished.
        if ts is not None and ts.state in ("processing", "memory"):
            self.live[key] = [s["state"] for s in states]

    # -- Dask hooks ----------------------------------------------------------------
    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if start == "memory" and finish != "memory":
            self.live.pop(key, None)

    def remove_worker(self, scheduler, worker, **kwargs) -> None:
        self.stats.pop(worker, None)

    # -- what the page (and tests) read ----------------------------------------------
    def totals(self) -> dict:
        return totals(self.stats)

    def sample(self) -> None:
        """Append the cluster totals to the history (only once there is something to show)."""
        if self.stats:
            self.history.append((time(), self.totals()))

    def lineage(self, state_id: str, depth: int = 12) -> list[dict]:
        """``state_id``'s summary, then its first parent's, and so on while known."""
        out: list[dict] = []
        sid: str | None = state_id
        while sid is not None and sid in self.states and len(out) < depth:
            s = self.states[sid]
            out.append(s)
            sid = s["parents"][0] if s.get("parents") else None
        return out

    def largest(self, n: int | None = None) -> list[list[dict]]:
        """Lineage chains of the ``n`` largest states seen (by KV bytes; newest first on ties).

        Each chain's head carries ``live``: whether a key in memory still holds it. States
        of finished computations stay listed (until ``MAX_STATES`` newer ones push them
        out): after a run is when people look.
        """
        n = self.largest_n if n is None else n
        live = {sid for sids in self.live.values() for sid in sids}
        order = {sid: i for i, sid in enumerate(self.states)}
        top = sorted(self.states, key=lambda sid: (-self.states[sid]["nbytes"], -order[sid]))[:n]
        return [[{**c, "live": c["state"] in live} for c in self.lineage(sid)] for sid in top]

    def sessions_plugin(self):
        """The sessions extension, when one runs (the page's sessions panel); else None."""
        return self.scheduler.plugins.get(SESSIONS_EXTENSION)

    def snapshot(self) -> dict:
        """Everything the page shows, as plain data (``client.run_on_scheduler``)."""
        return {
            "workers": dict(self.stats),
            "totals": self.totals(),
            "history": list(self.history),
            "largest": self.largest(),
            "sessions": self.sessions_plugin() is not None,
        }
