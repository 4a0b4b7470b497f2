"""Crashes on purpose: ``SIGKILL`` to worker processes of a local cluster, whose nannies restart them.

A real crash gives no warning and runs no cleanup, so the killer signals the process
(the nanny knows its id) rather than asking the worker to stop. The nanny starts a new
worker process, which joins with every registered plugin; :func:`back_to_full_strength`
waits for that and, when it does not happen, says what the nannies were doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Collection

from distributed import Client, LocalCluster

from dask_kvstate.testing.footprint import worker_footprint


def nanny_pids(cluster: LocalCluster) -> dict:
    """``{worker address: process id}`` of a local cluster's workers, as their nannies know them."""
    return {n.worker_address: n.pid for n in cluster.workers.values() if n.worker_address}


class Killer:
    """``SIGKILL`` to random worker processes, leaving at least ``min_alive`` running.

    A kill falls due whenever :meth:`owe` is called (the soak calls it every few finished
    workflows), so a fast machine, which finishes the workflows in seconds, sees as many
    kills per workflow as a loaded one, and the kills never outrun the work. Due kills
    wait for a victim: a worker up for ``min_uptime`` seconds at least (it holds KV and
    work), with at least ``min_alive`` others connected; at most ``max_owed`` wait at once,
    and two kills are ``spacing`` seconds apart at least.

    ``pids()`` maps each worker's address to its process id (the nannies know them), so a
    kill needs nothing from its victim. Just before, the victim's counters are read, if
    it answers within a few seconds, so the report counts what killed workers did too.
    It does not wait for the nanny's replacement to join: while one is loading its model
    the next kill may come, so the cluster sometimes runs on ``min_alive`` workers.
    """

    def __init__(
        self,
        client: Client,
        pids: Callable[[], dict],
        seed: int,
        min_alive: int = 1,
        min_uptime: float = 3.0,
        spacing: float = 1.0,
        max_owed: int = 2,
    ):
        self.client = client
        self.pids = pids
        self.spacing = spacing
        self.rng = random.Random(seed)
        self.min_alive = min_alive
        self.min_uptime = min_uptime
        self.max_owed = max_owed
        self.owed = 0  # kills due and not yet made
        self.kills: list[dict] = []
        #: each killed worker's counters, read just before its kill
        self.last_stats: dict[str, dict] = {}
        self.waited: Counter[str] = Counter()  # checks a due kill waited, by why
        self.unread = 0  # victims killed without their counters read
        self.joined: dict[str, float] = {}  # worker -> when the killer first saw it
        self._task: asyncio.Task | None = None

    def owe(self) -> None:
        """One more kill due now."""
        self.owed = min(self.owed + 1, self.max_owed)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            if self.owed and await self._kill_one():
                self.owed -= 1
                await asyncio.sleep(self.spacing)

    async def _kill_one(self) -> bool:
        assert self.client.scheduler is not None, "the killer needs a started client"
        workers = sorted((await self.client.scheduler.identity())["workers"])
        if len(workers) <= self.min_alive:
            self.waited["replacements not joined"] += 1
            return False
        pids = self.pids()
        now = time.monotonic()
        for w in workers:
            self.joined.setdefault(w, now)
        # A worker whose nanny does not know its address yet is still starting up.
        ready = [w for w in workers if pids.get(w) and now - self.joined[w] >= self.min_uptime]
        if not ready:
            self.waited["none up long enough"] += 1
            return False
        victim = self.rng.choice(ready)
        pid = pids[victim]
        try:
            seen = await asyncio.wait_for(self.client.run(worker_footprint, workers=[victim]), 3)
            self.last_stats[victim] = seen[victim].get("stats", {})
        except Exception:  # still setting up, or too busy to answer: killed all the same
            self.unread += 1
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it died on its own meanwhile
            return False
        self.kills.append({"t": time.time(), "worker": victim, "pid": pid})
        return True


async def back_to_full_strength(
    client: Client, cluster: LocalCluster, n: int, timeout: float, gone: Collection[str] = ()
) -> None:
    """Wait for ``n`` workers, none of them one of the ``gone`` (killed) addresses.

    A worker killed just before the wait is still listed until the scheduler sees its
    connection drop; counting it would let the caller talk to a dead process. A
    RuntimeError names each nanny's state, and why workers closed, if they do not come.
    """
    assert client.scheduler is not None, "needs a started client"
    gone = set(gone)
    end = time.monotonic() + timeout
    while True:
        workers = set((await client.scheduler.identity())["workers"])
        if len(workers) >= n and not workers & gone:
            return
        if time.monotonic() > end:
            nannies = [(name, str(nanny.status), nanny.worker_address) for name, nanny in cluster.workers.items()]
            closing = [
                (topic, msg.get("reason"))
                for topic, msgs in (await client.get_events()).items()
                for _, msg in msgs
                if isinstance(msg, dict) and msg.get("action") == "closing-worker"
            ]
            raise RuntimeError(
                f"{n} workers did not come back within {timeout} s; still listed after their kill "
                f"{sorted(workers & gone)}; nannies {nannies}; closed {closing}"
            )
        await asyncio.sleep(0.2)
