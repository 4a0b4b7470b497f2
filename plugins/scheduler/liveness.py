"""Which running workers the kvstate extensions send work to: those heard from lately.

Dask keeps a worker ``running`` until its ``worker-ttl`` passes (5 minutes by default) or
its stream to the scheduler breaks (after ``distributed.comm.timeouts.tcp``, 30 s by
default). Meanwhile a worker cut off from the network looks idle, the best place for
work: KV placement and stealing sent a state's consumers to its unreachable holder, the
one worker with the KV at hand, where they waited until Dask removed it (``tests/test_partition.py``
shows the cost).

So placement and stealing move work only to workers whose last heartbeat is recent: within
``transport.connect-timeout`` (what a consumer gives a holder before recomputing), or
two of Dask's heartbeat intervals (which grow with the cluster), whichever is longer. A
busy worker that misses that by a beat only loses a KV-aware move; Dask's own placement
and stealing are untouched.
"""

from __future__ import annotations

from collections.abc import Iterable

from distributed.metrics import time
from distributed.scheduler import heartbeat_interval

from dask_kvstate import config


def silence_limit(n_workers: int, connect_timeout: float | None = None) -> float:
    """Seconds without a heartbeat after which a worker of a cluster of ``n_workers`` gets
    no KV-aware work (``connect_timeout`` default: ``kvstate.transport.connect-timeout``).

    >>> silence_limit(3, 5.0), silence_limit(1000, 5.0)
    (5.0, 12.0)
    """
    if connect_timeout is None:
        connect_timeout = config.get_seconds("transport.connect-timeout")
    return max(connect_timeout, 2 * heartbeat_interval(n_workers))


def heard_from(workers: Iterable, n_workers: int, connect_timeout: float) -> list:
    """The ``WorkerState``s of ``workers`` whose last heartbeat is within :func:`silence_limit`."""
    oldest = time() - silence_limit(n_workers, connect_timeout)
    return [ws for ws in workers if ws.last_seen >= oldest]
