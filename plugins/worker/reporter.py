"""The worker half of observability: push this worker's stats to the ``observe`` extension.

The scheduler's dashboard page must never block its event loop on ``client.run``, so
workers push instead, over the batched stream they already keep open: their
``kvs.stats`` entry when it changed, and the states a task just computed (for the
lineage panel). The scheduler half is :mod:`dask_kvstate.plugins.scheduler.observe`.
"""

from __future__ import annotations

from distributed.comm.core import CommClosedError
from tornado.ioloop import PeriodicCallback

from dask_kvstate.protocol import STATES, STATS


def worker_stats(plugin) -> dict:
    """One worker's ``kvs.stats`` entry (also what it reports to the extension)."""
    if plugin is None or plugin.runtime is None:
        return {"installed": False}
    return {"installed": True, **plugin.runtime.stats(), "models": list(plugin.models)}


def state_summary(ref) -> dict:
    """What the extension keeps of a state: enough for a lineage line, never the text."""
    return {
        "state": ref.state_id,
        "op": ref.lineage.op,
        "parents": list(ref.lineage.parents),
        "tokens": ref.num_tokens,
        "nbytes": ref.nbytes,
        "model": ref.model_name,
    }


class StatsReporter:
    """Pushes a worker's stats to the observe extension when they change."""

    def __init__(self, worker, plugin, interval_s: float):
        self.worker = worker
        self.plugin = plugin
        self.last: dict | None = None
        self.callback = PeriodicCallback(self.report, interval_s * 1000)

    @classmethod
    def start(cls, worker, plugin, hello) -> StatsReporter | None:
        """A started reporter, or None when the scheduler runs no observe extension.

        ``hello`` is the observe extension's answer to the worker plugin's handshake.
        """
        if not isinstance(hello, dict) or "interval" not in hello:  # no observe extension
            return None
        self = cls(worker, plugin, float(hello["interval"]))
        self.callback.start()
        self.report()
        return self

    def _stream(self):
        bs = self.worker.batched_stream
        return bs if bs is not None and bs.comm is not None else None

    def _send(self, msg: dict) -> bool:
        """Send ``msg`` to the observe extension; False (never raises) when the stream is gone:
        a diagnostic lost with the scheduler, as every other message on that stream is."""
        stream = self._stream()
        if stream is None:
            return False
        try:
            stream.send(msg)
        except CommClosedError:
            return False
        return True

    def report(self) -> None:
        if self._stream() is None:  # idle and unconnected: not even the stats are gathered
            return
        stats = worker_stats(self.plugin)
        if stats != self.last and self._send({"op": STATS, "stats": stats}):
            self.last = stats

    def send_states(self, key, refs) -> None:
        self._send({"op": STATES, "key": key, "states": [state_summary(r) for r in refs]})

    def stop(self) -> None:
        self.callback.stop()
