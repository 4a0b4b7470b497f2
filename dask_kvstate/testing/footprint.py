"""What a kvstate cluster still holds: per worker and on the scheduler, and the wait for none.

After every workflow has finished and its session ended, a cluster that leaks nothing
holds no KV block in any tier, no pin, no hold, no ref key, no session record and no
spill file on any worker, and no ref or block report in the scheduler's placement
extension. :func:`settled` waits for that (the last releases and invalidations arrive
asynchronously) and returns what it saw last, so a leak is reported, not hidden.
"""

from __future__ import annotations

import asyncio
import os
import time

from distributed import Client

from dask_kvstate.protocol import LIFECYCLE_WORKER_PLUGIN, PLACEMENT_EXTENSION, SESSIONS_EXTENSION, WORKER_PLUGIN

#: The worker entries that must all be 0 once everything is released.
WORKER_ZEROS = (
    "blocks",
    "bytes",
    "device_bytes",
    "host_bytes",
    "disk_bytes",
    "meta",
    "pins",
    "holds",
    "session_bytes",
    "held_keys",
    "sessions",
    "leftovers",
    "spill_files",
    "tasks",
)
#: The scheduler entries that must all be 0.
SCHEDULER_ZEROS = ("tasks", "refs", "placed_blocks", "open_sessions", "closing_sessions")


def session_held_bytes(store) -> int:
    """Bytes of the blocks ``store`` holds for sessions (the lifecycle half's ``("session", id)`` holds)."""
    held = {
        h
        for owner, hs in list(store.holds.by_owner.items())
        if isinstance(owner, tuple) and owner[0] == "session"
        for h in hs
    }
    return sum(store.size_of(h) for h in held if h in store)


def worker_footprint(dask_worker) -> dict:
    """What this worker's kvstate plugins hold now (run with ``client.run``)."""
    from dask_kvstate.plugins.worker.reporter import worker_stats

    plugin = dask_worker.plugins.get(WORKER_PLUGIN)
    if plugin is None or plugin.runtime is None:
        return {"installed": False, "pid": os.getpid()}
    store = plugin.runtime.store
    life = dask_worker.plugins.get(LIFECYCLE_WORKER_PLUGIN)
    try:
        files = len(os.listdir(store.directory))
    except FileNotFoundError:
        files = 0
    return {
        "installed": True,
        "pid": os.getpid(),
        "blocks": len(store),
        "bytes": store.nbytes,
        "device_bytes": int(store.device.total_weight),
        "host_bytes": int(store.host.total_weight),
        "disk_bytes": int(store.disk.total),
        "meta": len(store.ledger.meta),
        "pins": len(store.pins.count) + len(store.pins.by_owner),
        "holds": len(store.holds.count) + len(store.holds.by_owner),
        "session_bytes": session_held_bytes(store),
        "held_keys": len(plugin.held),
        "sessions": len(life.sessions) if life is not None else 0,
        "leftovers": len(life.leftovers) if life is not None else 0,
        "spill_files": files,
        "tasks": len(dask_worker.state.tasks),
        "stats": worker_stats(plugin),
    }


def scheduler_footprint(dask_scheduler) -> dict:
    """What the scheduler still tracks (run with ``client.run_on_scheduler``)."""
    placement = dask_scheduler.plugins.get(PLACEMENT_EXTENSION)
    sessions = dask_scheduler.plugins.get(SESSIONS_EXTENSION)
    return {
        "tasks": len(dask_scheduler.tasks),
        "refs": len(placement.refs) if placement is not None else 0,
        "placed_blocks": sum(len(b) for b in placement.blocks_on.values()) if placement is not None else 0,
        "open_sessions": len(sessions.sessions) if sessions is not None else 0,
        "closing_sessions": len(sessions.closing) if sessions is not None else 0,
    }


def leaks(workers: dict, scheduler: dict) -> dict:
    """The non-zero entries of a footprint, ``{where: {entry: value}}`` (empty: nothing held).

    Examples
    --------
    >>> leaks({"w": {"blocks": 0, "pins": 2}}, {"refs": 0})
    {'w': {'pins': 2}}
    """
    out = {w: {k: v for k, v in f.items() if k in WORKER_ZEROS and v} for w, f in workers.items()}
    out["scheduler"] = {k: v for k, v in scheduler.items() if k in SCHEDULER_ZEROS and v}
    return {where: held for where, held in out.items() if held}


async def settled(client: Client, timeout: float, interval: float = 0.5) -> tuple[dict, dict]:
    """Poll until no worker and not the scheduler hold anything, or ``timeout`` seconds pass.

    Returns the last ``(workers, scheduler)`` footprints, zero or not. A worker that does
    not answer (a process going away as the poll reaches it) is asked again at the next
    poll; one still not answering at the timeout raises its error, naming the worker.
    """
    end = time.monotonic() + timeout
    while True:
        answers = await client.run(worker_footprint, on_error="return")
        failed = {w: a for w, a in answers.items() if isinstance(a, BaseException)}
        workers = {w: a for w, a in answers.items() if w not in failed}
        scheduler = await client.run_on_scheduler(scheduler_footprint)
        if not failed and not leaks(workers, scheduler):
            return workers, scheduler
        if time.monotonic() > end:
            if failed:
                worker, error = next(iter(failed.items()))
                raise RuntimeError(f"worker {worker} did not report its footprint: {error!r}") from error
            return workers, scheduler
        await asyncio.sleep(interval)
