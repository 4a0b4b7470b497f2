"""Live measurements behind the transfer-versus-recompute rule: no throughput constants.

* :class:`PrefillMeter` fits ``dask_kvstate.cost.prefill_seconds``' two coefficients
  for one model on one worker by least squares over its recent prefills (seeded by a
  probe when the plugin starts).
* :class:`LinkMeter` keeps an exponential moving average of KV pull bandwidth per
  peer, seeded from Dask's own bandwidth estimate until a real pull is seen.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np


class PrefillMeter:
    """``(per_token_s, per_pair_s)`` of one model, from observed ``(missing, cached, seconds)``.

    Examples
    --------
    >>> m = PrefillMeter()
    >>> for missing, cached in [(32, 0), (256, 0), (64, 512), (128, 1024)]:
    ...     m.add(missing, cached, missing * 1e-3 + missing * (cached + missing / 2) * 2e-6)
    >>> [round(x, 6) for x in m.coefficients()]
    [0.001, 2e-06]
    """

    def __init__(self, window: int = 64):
        self.obs: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None

    def add(self, missing: int, cached: int, seconds: float) -> None:
        if missing > 0 and seconds > 0:
            self.obs.append((int(missing), int(cached), float(seconds)))
            self._fit = None

    def coefficients(self) -> tuple[float, float]:
        if not self.obs:
            raise ValueError("no prefill observed yet: the plugin's probe seeds this")
        # The worker plugin reports these every placement.report-interval; the fit (numpy arrays and a
        # least-squares solve) cost ~1 ms of worker CPU each time (measured in a profile), so
        # it is redone only after a new observation.
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float]:
        m, c, t = (np.array(col, dtype=float) for col in zip(*self.obs))
        x = np.stack([m, m * (c + m / 2)], axis=1)
        (a, b), *_ = np.linalg.lstsq(x, t, rcond=None)
        if a < 0 or b < 0:  # noise on too few points: keep the physically meaningful term
            b = max(b, 0.0) if a >= 0 else 0.0
            a = float(np.dot(t - b * x[:, 1], m) / np.dot(m, m))
            a = max(a, 0.0)
        return float(a), float(b)


class LinkMeter:
    """Pull cost per peer: ``latency + bytes / bandwidth``, fitted from real pulls.

    Per peer, a least-squares fit over its recent pulls once they differ in size;
    before that, the last pull with the current latency estimate; before any pull,
    Dask's own estimates (the seeds).

    Examples
    --------
    >>> link = LinkMeter(seed_bandwidth=1e8, latency=1e-3)
    >>> for n in (10_000, 1_000_000, 4_000_000):
    ...     link.add("w1", n, 0.030 + n / 2e8)
    >>> round(link.latency, 3), round(link.bandwidth("w1") / 1e8, 1), link.bandwidth("w2")
    (0.03, 2.0, 100000000.0)
    """

    def __init__(self, seed_bandwidth: float, latency: float = 1e-3, window: int = 32):
        self.seed = float(seed_bandwidth)
        self.latency = float(latency)
        self.window = window
        self.obs: dict[str, deque[tuple[int, float]]] = {}
        self.per_peer: dict[str, float] = {}
        # pulls cut off by the puller finish on the event loop and are measured there,
        # while task threads measure their own pulls
        self._lock = threading.Lock()

    def add(self, peer: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._add(peer, nbytes, seconds)

    def forget(self, peer: str) -> None:
        """Drop what was measured of ``peer``'s link (its bandwidth is the seed again)."""
        with self._lock:
            self.obs.pop(peer, None)
            self.per_peer.pop(peer, None)

    def measured(self, peer: str) -> bool:
        """Whether a pull from ``peer`` has been timed (else its bandwidth is the seed)."""
        return bool(self.obs.get(peer))

    def _add(self, peer: str, nbytes: int, seconds: float) -> None:
        obs = self.obs.setdefault(peer, deque(maxlen=self.window))
        obs.append((nbytes, seconds))
        if len({n for n, _ in obs}) >= 2:
            n, t = (np.array(col, dtype=float) for col in zip(*obs))
            (lat, inv_bw), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], axis=1), t, rcond=None)
            if lat >= 0 and inv_bw > 0:
                self.latency, self.per_peer[peer] = float(lat), float(1 / inv_bw)
                return
        self.per_peer[peer] = nbytes / max(seconds - self.latency, seconds * 0.05)

    def bandwidth(self, peer: str) -> float:
        return self.per_peer.get(peer, self.seed)
