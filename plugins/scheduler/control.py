"""The global control loop (Nalar 4.2): one periodic, single-threaded pass over policies.

Nalar's global controller runs out of band: task execution never waits for it, it
only revises decisions (priorities, placement, capacity) every interval. On a Dask
scheduler that is a tornado ``PeriodicCallback`` on the scheduler's event loop (how
``WorkStealing.balance`` runs), so every policy sees a consistent scheduler state and
no two policies race. Each pass is timed per policy and in total: the loop's latency
is what ``kvs.stats(client).scheduling`` reports.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from time import perf_counter

from tornado.ioloop import PeriodicCallback

logger = logging.getLogger("dask_kvstate")

WINDOW = 1000  # passes kept for the latency percentiles


def latency_summary(samples) -> dict:
    """Count, mean, p50, p99 and max of durations in seconds, reported in milliseconds.

    Examples
    --------
    >>> latency_summary([0.001, 0.002, 0.003])["p50_ms"]
    2.0
    >>> latency_summary([])["count"]
    0
    """
    xs = sorted(samples)
    if not xs:
        return {"count": 0}
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3
    return {
        "count": len(xs),
        "mean_ms": sum(xs) / len(xs) * 1e3,
        "p50_ms": pick(0.5),
        "p99_ms": pick(0.99),
        "max_ms": xs[-1] * 1e3,
    }


class ControlLoop:
    """Policies run in registration order every ``interval_s``; ``every=n`` runs one each n-th pass."""

    def __init__(self, interval_s: float):
        assert interval_s > 0, f"interval must be > 0 seconds, got {interval_s}"
        self.interval_s = interval_s
        self.policies: dict[str, tuple[Callable[[], None], int]] = {}
        self.latency: dict[str, deque] = {"total": deque(maxlen=WINDOW)}
        self.passes = 0
        self._pc: PeriodicCallback | None = None

    def add(self, name: str, fn: Callable[[], None], every: int = 1) -> None:
        self.policies[name] = (fn, max(int(every), 1))
        self.latency.setdefault(name, deque(maxlen=WINDOW))

    def start(self) -> None:
        if self._pc is None:
            self._pc = PeriodicCallback(self.run_once, self.interval_s * 1000)
            self._pc.start()

    def stop(self) -> None:
        if self._pc is not None:
            self._pc.stop()
            self._pc = None

    def run_once(self) -> None:
        """One pass; a failing policy is logged and the others still run."""
        self.passes += 1
        t0 = perf_counter()
        for name, (fn, every) in list(self.policies.items()):
            if self.passes % every:
                continue
            t = perf_counter()
            try:
                fn()
            except Exception:
                logger.exception("kvstate control policy %s failed", name)
            self.latency[name].append(perf_counter() - t)
        self.latency["total"].append(perf_counter() - t0)

    def stats(self) -> dict:
        return {
            "interval_ms": self.interval_s * 1e3,
            "passes": self.passes,
            **{name: latency_summary(v) for name, v in self.latency.items()},
        }
