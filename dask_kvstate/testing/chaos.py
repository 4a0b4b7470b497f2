"""The chaos soak: hundreds of workflows on a cluster whose workers crash and whose disk fills.

:func:`soak` starts a real cluster of worker processes under nannies with the lifecycle
on and tier budgets small enough that blocks spill to the disk tier, which sits on a
small filesystem of its own (a tmpfs, so a full disk is a real ``ENOSPC``; a plain
folder where mounting is not allowed, and then only the disk tier's budget fills). It
computes each distinct workflow's text replay once, then runs the mix of
:mod:`~dask_kvstate.testing.workflow_mix` while

* a :class:`~dask_kvstate.testing.killer.Killer` sends ``SIGKILL`` to a random worker
  process every few finished workflows, every few seconds (the nanny starts a new one,
  which joins with every plugin),
* a :class:`~dask_kvstate.testing.disk_fill.DiskFiller` fills the disk to the last byte
  a third of the way through and frees it again two thirds through,
* on the vLLM backend, half way through, one engine step fails
  (:func:`~dask_kvstate.testing.engine_faults.fail_steps`) on every live worker.

Every workflow must end by a deadline with outputs token-identical to text replay; then
the cluster must settle to nothing held (:mod:`~dask_kvstate.testing.footprint`). The
report counts kills, blocks recomputed, failed pulls and tasks Dask re-ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import time
from collections import Counter
from collections.abc import Awaitable
from typing import cast

import dask
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.protocol import WORKER_PLUGIN
from dask_kvstate.testing.disk_fill import DiskFiller, small_disk
from dask_kvstate.testing.footprint import leaks, settled
from dask_kvstate.testing.killer import Killer, back_to_full_strength, nanny_pids
from dask_kvstate.testing.workflow_mix import Spec, mix, run_workflow
from dask_kvstate.views import Stats


@dataclasses.dataclass(frozen=True)
class Engine:
    """What the soak runs per backend: the model, its block size and one block's KV bytes."""

    model: str
    block_tokens: int
    block_bytes: int
    config: dict = dataclasses.field(default_factory=dict)


ENGINES = {
    "hf": Engine("tiny-llama", 16, 16 * 512),
    # vLLM's CPU attention takes multiples of 32 tokens a block; SmolLM2-135M keeps 46,080 bytes a token.
    "vllm": Engine("smollm2-135m", 64, 64 * 46_080, {"kvstate.vllm.kv-cache-bytes": "1GiB"}),
}

#: tiny-llama's KV bytes per block at 16 tokens a block.
BLOCK = ENGINES["hf"].block_bytes

#: The config the soak runs under (besides ``kvstate.lifecycle.enabled``, set by ``kvs.install``,
#: and the engine's block size).
CONFIG = {
    "kvstate.placement.rule": "pull",  # consumers pull from holders, so kills break pulls
    "kvstate.transport.connect-timeout": "1s",  # a dead holder fails a pull fast
    "kvstate.scheduling.interval": "100ms",
    # A task may be on several killed workers in a row; Dask's default (3) would give up on it.
    "distributed.scheduler.allowed-failures": 100,
    # A LocalCluster closes for good a nanny whose restarted worker has not joined within
    # this (15 s by default), which a loaded machine loading torch and a model can exceed.
    "distributed.deploy.lost-worker-timeout": "10 minutes",
}

#: The counters summed over every worker process, killed ones included.
COUNTED = ("recomputes", "recompute_tokens", "transfer_failures", "transfers", "materializations", "resumes")


@dataclasses.dataclass
class SoakOptions:
    backend: str = "hf"  # a key of ENGINES
    workflows: int = 200
    workers: int = 3
    live: int = 12  # workflows in flight at once
    kill_per: int = 10  # a kill falls due every this many finished workflows
    min_alive: int = 1  # workers the killer always leaves running
    deadline: float = 300.0  # seconds for every workflow to finish
    settle: float = 60.0  # seconds for the cluster to hold nothing afterwards
    disk_blocks: int = 1024  # blocks the small filesystem under the disk tiers holds
    device_blocks: int = 24  # blocks a worker's device tier holds
    host_blocks: int = 24
    tool_seconds: float = 0.3
    full_wait: float = 30.0  # the most seconds the disk stays full past its slot, until a spill meets ENOSPC
    seed: int = 0
    out: str | None = None  # a JSON file for the report

    def __post_init__(self):
        if self.backend not in ENGINES:
            raise ValueError(f"unknown soak backend {self.backend!r}; choose one of {sorted(ENGINES)}")

    @property
    def engine(self) -> Engine:
        return ENGINES[self.backend]

    @property
    def disk_size(self) -> int:
        return self.disk_blocks * self.engine.block_bytes


async def references(client: Client, specs: list[Spec], deadline: float) -> dict:
    """Text replay of each distinct workflow of ``specs``, once: ``{reference key: token ids}``."""
    firsts = {s.reference_key: s for s in specs}
    got = await asyncio.gather(*(run_workflow(client, s, False, deadline) for s in firsts.values()))
    return dict(zip(firsts, got))


async def drive(
    client: Client, specs: list[Spec], want: dict, opts: SoakOptions, filler: DiskFiller, killer: Killer
) -> list[dict]:
    """Run every workflow (``opts.live`` at a time) to its end or the deadline; one outcome each."""
    deadline = time.monotonic() + opts.deadline
    gate = asyncio.Semaphore(opts.live)
    done = Counter[str]()
    fill_at, free_at = len(specs) // 3, 2 * len(specs) // 3
    fail_at = len(specs) // 2 if opts.backend == "vllm" else None

    async def one(spec: Spec) -> dict:
        async with gate:
            t0 = time.monotonic()
            try:
                got = await run_workflow(client, spec, True, deadline)
            except asyncio.TimeoutError:
                outcome, error = "hung", None
            except Exception as e:
                outcome, error = "failed", repr(e)[:300]
            else:
                outcome, error = ("identical" if got == want[spec.reference_key] else "different"), None
            seconds = time.monotonic() - t0
        done["n"] += 1
        if done["n"] % opts.kill_per == 0:
            killer.owe()
        if done["n"] == fail_at:
            await cast(Awaitable[dict], client.run(_fail_a_step, on_error="ignore"))
        if done["n"] == fill_at:
            await asyncio.to_thread(filler.fill)
        elif done["n"] == free_at:
            if filler.filled:
                await disk_said_full(client, killer, opts.full_wait)
            filler.release()
        return {
            "index": spec.index,
            "kind": spec.kind,
            "variant": spec.variant,
            "outcome": outcome,
            "error": error,
            "seconds": round(seconds, 3),
        }

    return await asyncio.gather(*(one(s) for s in specs))


def _fail_a_step(dask_worker) -> bool:
    """The next engine step of this worker fails; False on a restarted worker still setting up."""
    from dask_kvstate.testing.engine_faults import fail_steps

    plugin = dask_worker.plugins.get(WORKER_PLUGIN)
    if plugin is None or plugin.runtime is None:
        return False
    fail_steps(plugin.runtime.backend, 1)
    return True


def _disk_full_count(dask_worker) -> int:
    plugin = dask_worker.plugins.get(WORKER_PLUGIN)
    if plugin is None or plugin.runtime is None:  # a restarted worker still setting up
        return 0
    return int(plugin.runtime.store.counters["disk"]["full"])


async def disk_said_full(client: Client, killer: Killer, timeout: float) -> None:
    """Keep the disk full until some worker's spill has met ``ENOSPC`` (at most ``timeout`` s).

    Whether a spill falls inside the full window depends on the run's timing; without
    this, a run could pass without ever exercising a full disk.
    """
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(s.get("tiers", {}).get("disk", {}).get("full", 0) for s in killer.last_stats.values()):
            return
        counts = await cast(Awaitable[dict], client.run(_disk_full_count, on_error="ignore"))
        if any(counts.values()):
            return
        await asyncio.sleep(0.25)  # polling the workers' counters; nothing to wait on


async def dask_reruns(client: Client, addresses) -> dict:
    """Tasks Dask re-ran because a killed worker was running them, or had lost their results."""
    out = Counter[str]()
    for addr in addresses:
        for _, msg in await client.get_events(addr):
            if isinstance(msg, dict) and msg.get("action") == "remove-worker":
                out["retries"] += len(msg.get("processing-tasks", ()))
                out["lost_results"] += len(msg.get("lost-computed-tasks", ()))
    return dict(out)


def totals(final: dict, killed: dict) -> dict:
    """:data:`COUNTED` summed over the live workers' final stats and the killed ones' last."""
    entries = [f.get("stats", {}) for f in final.values()] + list(killed.values())
    out = {name: sum(e.get(name, 0) for e in entries) for name in COUNTED}
    out["disk_full"] = sum(e.get("tiers", {}).get("disk", {}).get("full", 0) for e in entries)
    out["checksum_failures"] = sum(e.get("tiers", {}).get("disk", {}).get("checksum_failures", 0) for e in entries)
    out["dropped"] = sum(e.get("dropped", 0) for e in entries)
    out["failed_steps"] = sum(e.get("engine", {}).get("failed_steps", 0) for e in entries)
    out["retried_requests"] = sum(e.get("engine", {}).get("retried_requests", 0) for e in entries)
    return out


async def soak(opts: SoakOptions) -> dict:
    """Run the soak; the report (also written to ``opts.out`` as JSON)."""
    t_start = time.monotonic()
    specs = mix(opts.workflows, opts.seed, opts.tool_seconds)
    engine = opts.engine
    config = {**CONFIG, **engine.config, "kvstate.block-tokens": engine.block_tokens}
    with small_disk(opts.disk_size) as (disk, mounted), dask.config.set(config):
        filler = DiskFiller(disk, enabled=mounted)
        async with (
            LocalCluster(
                n_workers=opts.workers,
                threads_per_worker=2,
                processes=True,
                dashboard_address=":0",
                local_directory=disk,
                asynchronous=True,
            ) as cluster,
            Client(cluster, asynchronous=True) as client,
        ):
            # An asynchronous client gets awaitables from both (typed for the synchronous one).
            await cast(
                "Awaitable[dict]",
                kvs.install(
                    client,
                    engine.model,
                    backend=opts.backend,
                    lifecycle=True,
                    torch_threads=1,
                    device_bytes=opts.device_blocks * engine.block_bytes,
                    host_bytes=opts.host_blocks * engine.block_bytes,
                    # On a tmpfs only the real disk says no; otherwise the budget is the disk's size.
                    disk_bytes="1GiB" if mounted else opts.disk_size // opts.workers,
                ),
            )
            want = await references(client, specs, time.monotonic() + opts.deadline)
            killer = Killer(client, functools.partial(nanny_pids, cluster), opts.seed, opts.min_alive)
            t0 = time.monotonic()
            killer.start()
            try:
                outcomes = await drive(client, specs, want, opts, filler, killer)
            finally:
                await killer.stop()
                filler.release()
            wall = time.monotonic() - t0
            await back_to_full_strength(
                client, cluster, opts.workers, timeout=120, gone={k["worker"] for k in killer.kills}
            )
            final, scheduler = await settled(client, opts.settle)
            reruns = await dask_reruns(client, {k["worker"] for k in killer.kills})
            stats = await cast("Awaitable[Stats]", kvs.stats(client))
    report = {
        "options": dataclasses.asdict(opts),
        "model": engine.model,
        "tmpfs": mounted,
        "workflows": len(outcomes),
        "outcomes": dict(Counter(o["outcome"] for o in outcomes)),
        "by_kind": {
            k: dict(Counter(o["outcome"] for o in outcomes if o["kind"] == k)) for k in sorted({s.kind for s in specs})
        },
        "references": len(want),
        "kills": len(killer.kills),
        "kills_waited": dict(killer.waited),
        "kills_counters_unread": killer.unread,
        **totals(final, killer.last_stats),
        "retries": reruns.get("retries", 0),
        "lost_results": reruns.get("lost_results", 0),
        "sessions_ended": stats.scheduling["sessions"].get("ended", 0),
        # Tasks of graphs that reached the scheduler after their session had ended: they ran in no session.
        "late_tasks": stats.scheduling["sessions"].get("late_tasks", 0),
        "lifecycle": {k: v for k, v in stats.lifecycle.items() if isinstance(v, int) and not isinstance(v, bool)},
        "disk": filler.events,
        "run_seconds": round(wall, 1),
        "total_seconds": round(time.monotonic() - t_start, 1),
        "final": {
            "bytes": sum(f.get("bytes", 0) for f in final.values()),
            "pins": sum(f.get("pins", 0) for f in final.values()),
            "holds": sum(f.get("holds", 0) for f in final.values()),
            "blocks": sum(f.get("blocks", 0) for f in final.values()),
            "leaks": leaks(final, scheduler),
        },
        "problems": [o for o in outcomes if o["outcome"] != "identical"],
    }
    if opts.out:
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
        with open(opts.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def summary(report: dict) -> str:
    """The report in one paragraph, for a test's output and the command line."""
    f = report["final"]
    return (
        f"chaos soak: {report['workflows']} workflows, {report['outcomes']}; {report['kills']} kills, "
        f"{report['recomputes']} blocks recomputed ({report['recompute_tokens']} tokens), "
        f"{report['transfer_failures']} failed pulls, {report['retries']} tasks re-run by Dask "
        f"({report['lost_results']} lost results), disk full {report['disk_full']}x "
        f"({'tmpfs' if report['tmpfs'] else 'budget only'}), {report['dropped']} blocks dropped, "
        f"{report['failed_steps']} engine steps failed ({report['retried_requests']} requests retried); "
        f"{report['run_seconds']} s of chaos, {report['total_seconds']} s in all; at the end "
        f"{f['bytes']} KV bytes, {f['pins']} pins, {f['holds']} holds, leaks {f['leaks'] or 'none'}"
    )
