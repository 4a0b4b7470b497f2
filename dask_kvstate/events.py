"""Event topics: where kvstate decisions and lifecycle changes go in Dask's event log.

Everything goes through Dask's own log (``Scheduler.log_event`` on the scheduler,
``Worker.log_event`` on workers, which forwards over the worker's batched stream), so
``client.get_events("kvstate-placement")``, ``client.subscribe_topic`` and the
dashboard's event views show it without anything of ours in between.

Per-block events would flood the log (a 4,000-token state is 64 blocks), so events
are per decision (placement, a compatibility refusal, an explicit evict) or aggregated
per report interval (spills, unspills and drops of the block store, counted from the
workers' periodic stats; see :mod:`dask_kvstate.plugins.scheduler.observe`).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("dask_kvstate")

#: Scheduler placement decisions and the measured outcome of each (plugins/placement.py).
PLACEMENT = "kvstate-placement"
#: A state not reused because model, config or positions differ (recomputed from text).
COMPATIBILITY = "kvstate-compatibility"
#: Block store lifecycle: explicit evictions, per-interval spill/unspill/drop counts, and
#: the kv-lifecycle extension's offload / prefetch / invalidate decisions.
LIFECYCLE = "kvstate-lifecycle"
#: Late-binding moves of queued work (the stealing extension).
STEALING = "kvstate-stealing"

TOPICS = (PLACEMENT, COMPATIBILITY, LIFECYCLE, STEALING)


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
