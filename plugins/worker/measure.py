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
        a, b = _relative_fit(x, t)
        # a prefill timed while the machine was busy with something else (another process,
        # a spill) is off by a factor, not by seconds: leave out points the fit misses by
        # more than 2x either way, once, if enough remain
        pred = x @ np.array([a, b])
        keep = (pred <= 2 * t) & (t <= 2 * np.maximum(pred, 1e-12))
        if 3 <= keep.sum() < len(t):
            a, b = _relative_fit(x[keep], t[keep])
        return a, b


def _relative_fit(x: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """Least squares of ``x @ (a, b) = t`` in relative error, both coefficients kept non-negative.

    In relative error every prefill counts alike: in seconds, the longest few would set
    the fit, and one of them timed under load would move every estimate.
    """
    w = 1.0 / t
    (a, b), *_ = np.linalg.lstsq(x * w[:, None], t * w, rcond=None)
    if a < 0 or b < 0:  # noise on too few points: keep the term every token pays
        xs = x[:, 0] * w
        a, b = max(float(np.dot(xs, t * w) / np.dot(xs, xs)), 0.0), 0.0
    return float(a), float(b)


class LinkMeter:
    """Pull cost per peer: ``latency + bytes / bandwidth``, fitted from real pulls.

    Per peer, a least-squares fit over its recent pulls once two of them differ enough
    in size (the larger at least twice the smaller): then both the peer's latency and
    its bandwidth are known (:meth:`fitted`). Before that, one pull size gives the
    bandwidth with the latency of the fitted peers (their median), or the seed latency;
    before any pull, Dask's own measurement of that peer (``seeds``) or its global
    estimate (the seed bandwidth).

    :meth:`floor` is the most the link is known to carry for sure: the fastest of its
    pulls, bytes over their whole time (latency included), so never above the rate of
    a link that sends at its rate from its first byte. The puller commits to a large
    pull on the floor, where a fit from small probes may be far off.

    Examples
    --------
    >>> link = LinkMeter(seed_bandwidth=1e8, latency=1e-3)
    >>> for n in (10_000, 1_000_000, 4_000_000):
    ...     link.add("w1", n, 0.030 + n / 2e8)
    >>> round(link.latency_to("w1"), 3), round(link.bandwidth("w1") / 1e8, 1), link.bandwidth("w2")
    (0.03, 2.0, 100000000.0)
    >>> round(link.latency_to("w2"), 3), link.fitted("w1"), link.fitted("w2")
    (0.03, True, False)
    >>> round(link.floor("w1") / 1e8, 2), link.floor("w2")
    (0.8, 0.0)
    """

    def __init__(self, seed_bandwidth: float, latency: float = 1e-3, window: int = 16, seeds=None):
        self.seed = float(seed_bandwidth)
        self.seed_latency = float(latency)
        self.window = window
        self.seeds = seeds  # peer -> Dask's own measured bandwidth of it, or None
        self.obs: dict[str, deque[tuple[int, float]]] = {}
        self.per_peer: dict[str, float] = {}  # bandwidth, bytes/s
        self.latencies: dict[str, float] = {}  # fitted peers only
        # pulls cut off by the puller finish on the event loop and are measured there,
        # while task threads measure their own pulls
        self._lock = threading.Lock()

    @property
    def latency(self) -> float:
        """Latency of a peer not fitted yet: the median of the fitted peers', or the seed."""
        fitted = sorted(self.latencies.values())
        return fitted[len(fitted) // 2] if fitted else self.seed_latency

    def latency_to(self, peer: str) -> float:
        return self.latencies.get(peer, self.latency)

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
            self.latencies.pop(peer, None)

    def measured(self, peer: str) -> bool:
        """Whether a pull from ``peer`` has been timed (else its bandwidth is a seed)."""
        return bool(self.obs.get(peer))

    def fitted(self, peer: str) -> bool:
        """Whether ``peer``'s latency and bandwidth are both fitted (pulls of two sizes)."""
        return peer in self.latencies

    def largest(self, peer: str) -> int:
        """Bytes of the largest pull from ``peer`` still in the window (0 if none)."""
        return max((n for n, _ in self.obs.get(peer, ())), default=0)

    def floor(self, peer: str) -> float:
        """Bytes/s ``peer``'s link surely carries: its fastest pull, whole time counted (0 if none)."""
        return max((n / t for n, t in self.obs.get(peer, ())), default=0.0)

    def _add(self, peer: str, nbytes: int, seconds: float) -> None:
        obs = self.obs.setdefault(peer, deque(maxlen=self.window))
        obs.append((nbytes, seconds))
        sizes = [n for n, _ in obs]
        if max(sizes) >= 2 * min(sizes):
            n, t = (np.array(col, dtype=float) for col in zip(*obs))
            (lat, inv_bw), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], axis=1), t, rcond=None)
            if lat >= 0 and inv_bw > 0:
                self.latencies[peer], self.per_peer[peer] = float(lat), float(1 / inv_bw)
                return
        # one size, or a fit that noise made unphysical: the median pull, each over a
        # latency no larger than half the fastest pull seen (one slow pull moves nothing)
        self.latencies.pop(peer, None)
        lat = min(self.latency, min(t for _, t in obs) * 0.5)
        rates = sorted(n / max(t - lat, t * 0.05) for n, t in obs)
        self.per_peer[peer] = rates[len(rates) // 2]

    def bandwidth(self, peer: str) -> float:
        if peer in self.per_peer:
            return self.per_peer[peer]
        dask_measured = self.seeds(peer) if self.seeds is not None else None
        return dask_measured or self.seed


def dask_bandwidth(worker, peer: str) -> float | None:
    """Dask's own measurement of ``peer``'s link from this worker: the median bandwidth of
    its task-data transfers from ``peer`` large enough for Dask to count (over 1 MB), or None."""
    log = getattr(worker, "transfer_incoming_log", None) or ()
    rates = sorted(e["bandwidth"] for e in list(log) if e.get("who") == peer and e.get("total", 0) > 1_000_000)
    return rates[len(rates) // 2] if rates else None
