"""What a worker's runtime counts: decode-time KV, the peak of all KV held, and its stats.

The block store counts its own tiers; the KV that generations hold in their decode
caches lies outside it. :class:`LiveKV` adds those bytes while they live, so
``kv_peak_bytes`` is the most KV this worker held at once, the number the benchmarks
compare across text replay, the prefix cache and kvstate.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter


class LiveKV:
    """Bytes of decode caches alive now, and ``counters["kv_peak_bytes"]``.

    The peak is the store's device tier plus the caches of the generations running
    then (each at its final size: an upper bound when a row stops early at EOS).
    """

    def __init__(self, store, counters: Counter):
        self.store = store
        self.counters = counters
        self.nbytes = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, nbytes: int):
        """Count ``nbytes`` of decode-time KV while inside."""
        with self._lock:
            self.nbytes += nbytes
            now = self.store.device.total_weight + self.nbytes
            self.counters["kv_peak_bytes"] = max(self.counters["kv_peak_bytes"], now)
        try:
            yield
        finally:
            with self._lock:
                self.nbytes -= nbytes


def runtime_stats(model: str, store, counters: Counter) -> dict:
    """One runtime's entry of ``kvs.stats``: its model, the store's numbers and its counters."""
    # Tokens whose KV came from a state (or the prefix cache) instead of a prefill.
    avoided = {"prefill_tokens_avoided": counters["reused_tokens"]}
    return {"model": model, **store.stats(), **dict(counters), **avoided}
