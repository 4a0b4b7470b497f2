"""Events from a worker into Dask's event log, which never fail the task that sends them.

``Worker.log_event`` forwards over the worker's batched stream, so
``client.get_events(topic)``, ``client.subscribe_topic`` and the dashboard's event views
show kvstate's events with nothing of ours in between. Topics are in
:mod:`dask_kvstate.protocol`. Per-block events would flood the log (a 4,000-token state
is 64 blocks), so events are per decision (a compatibility refusal, an explicit evict)
or counted per report interval on the scheduler (spills, unspills, drops).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("dask_kvstate")


def worker_event(worker, topic: str, msg: dict) -> None:
    """Log ``msg`` under ``topic`` from a worker (any thread); never raises.

    An event is a diagnostic: losing one (worker closing, no scheduler stream yet)
    must never fail the task that produced it.
    """
    if worker is None:
        return
    try:
        worker.log_event(topic, msg)
    except Exception as e:
        logger.debug("kvstate: event %s not logged (%s: %s)", topic, type(e).__name__, e)
