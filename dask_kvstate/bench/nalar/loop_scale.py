"""How the global control loop's pass grows with the queue: 10^3 to 10^5 futures over 10^3 sessions.

Each point is one fresh in-process cluster (``SpecCluster`` of single-thread ``Worker``
objects sharing this process and its event loop, as Dask's own scheduler tests run)
with every policy on: priority, stealing, capacity (the workers hold ``role:*`` units)
and the KV lifecycle. Two phases, as :mod:`.loop_latency`: role-restricted tasks queued
behind busy role workers, and root-ish tasks queued on the scheduler. The sessions
(``kvs.session``, one ``c.map`` each) stay open while the loop is measured.

**The trickle.** The priority policy only revises sessions whose progress changed, so
tasks must complete while the queue stays full. Every task waits on :data:`GATE` (the
workers share this process, so one ``threading.Event`` reaches them all), which opens
once every future is on the scheduler; then each worker finishes one task every
``d = max(0.5 s, workers * seconds / (drain * futures))``: about ``drain`` (a fifth) of
the queue completes while the loop is measured at the small sizes, and 2 tasks a second
per worker (40 completions a pass over 100 workers) at the large ones, so the queue
never falls under 80% full.

**The lifecycle.** ``kvs.install(c, model=False)`` installs no block store, and so no
lifecycle (it has no KV to move): it is registered here directly, its worker half too
(whose handlers do nothing without a store), and each worker's lifecycle report is
emulated as holding 1 MiB of device KV for each session ``i`` with ``i % workers`` its
index, so the lifecycle pass predicts every live session against its tasks, as it does
on a cluster serving KV.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from contextlib import ExitStack

from distributed import Client, Worker

import dask_kvstate as kvs
from dask_kvstate.bench.nalar.runner import CONFIGS, policy_cluster
from dask_kvstate.bench.nalar.workflows import role
from dask_kvstate.plugins.scheduler.lifecycle import KVLifecycle
from dask_kvstate.plugins.worker.lifecycle import KVLifecycleWorkerPlugin
from dask_kvstate.protocol import LIFECYCLE_EXTENSION, PRIORITY_EXTENSION, SESSIONS_EXTENSION

#: Opened once every future of a point is on the scheduler: until then every task waits.
GATE = threading.Event()
PHASES = ("role-restricted, queued on workers", "root-ish, queued on the scheduler")
ROLES = {"planner": 0.25, "developer": 0.5, "tester": 0.25}  # share of the workers per role
SIZES = (1_000, 10_000, 100_000)
POLICIES = ("sessions", "priority", "stealing", "capacity", "lifecycle")
LIMIT_MS = 50.0
KV_BYTES = 2**20  # device KV per session in the emulated lifecycle reports
#: What a hundred workers in one process would otherwise spend the CPU on, off as in
#: ``distributed.utils_test``: each one's system monitor (psutil reads, a listing of every
#: open file of the process twice a second) and its statistical profiler.
HARNESS = {
    "distributed.admin.system-monitor.interval": "1h",
    "distributed.admin.system-monitor.gil.enabled": False,
    "distributed.worker.profile.enabled": False,
}


def gated(seconds: float, i: int) -> float:
    """A task of ``seconds`` that starts its clock only once :data:`GATE` opens."""
    GATE.wait()
    time.sleep(seconds)
    return seconds


def spec(workers: int) -> dict:
    """``workers`` single-thread workers, each offering one unit of a role (:data:`ROLES` shares)."""
    out, i = {}, 0
    for r, share in ROLES.items():
        for _ in range(max(1, round(share * workers))):
            out[f"{r}-{i}"] = {"cls": Worker, "options": {"nthreads": 1, "resources": role(r)}}
            i += 1
    return out


def _emulate_reports(dask_scheduler) -> int:
    """Each worker's lifecycle report, as if it held KV for the sessions of its index (see the module doc)."""
    ext = dask_scheduler.plugins[LIFECYCLE_EXTENSION]
    sessions = list(dask_scheduler.plugins[SESSIONS_EXTENSION].sessions)
    workers = sorted(dask_scheduler.workers)
    rates = {f"{a}:{t}": r for a in ("offload", "restore") for t, r in (("host", 5e9), ("disk", 1e9))}
    for w, addr in enumerate(workers):
        own = {sid: {"device": KV_BYTES, "host": 0, "disk": 0} for sid in sessions[w :: len(workers)]}
        device = {"bytes": KV_BYTES * len(own), "capacity": 1 << 40}
        ext.reports[addr] = {"device": device, "host": {"bytes": 0, "capacity": 1 << 40}, "sessions": own}
        ext.reports[addr]["rates"] = rates
        ext.announced.add(addr)
    return len(workers)


def _unhook_invalidations(dask_scheduler) -> None:
    """Every session ends at once when the futures are cancelled, and the lifecycle then asks
    every worker to invalidate every session at once (10^5 RPCs at 10^3 sessions on 100
    workers, more sockets than the process may open): after the measurement, so it is skipped."""
    ext = dask_scheduler.plugins[LIFECYCLE_EXTENSION]
    if ext._on_end in ext.tracker.on_end:
        ext.tracker.on_end.remove(ext._on_end)


def _state(dask_scheduler, reset: bool = False) -> dict:
    """What the queue and the loop look like; ``reset`` clears the latency samples first."""
    tracker = dask_scheduler.plugins[SESSIONS_EXTENSION]
    loop = tracker.loop
    if reset:
        for samples in loop.latency.values():
            samples.clear()
    priority = dask_scheduler.plugins[PRIORITY_EXTENSION].counters
    return {
        "tasks": len(dask_scheduler.tasks),
        "queued_on_scheduler": len(dask_scheduler.queued),
        "queued_on_workers": sum(max(len(ws.processing) - ws.nthreads, 0) for ws in dask_scheduler.workers.values()),
        "sessions": len(tracker.sessions),
        "completed": sum(s.completed for s in tracker.sessions.values()),
        "revised": sum(priority[k] for k in ("queued_revised", "worker_revised", "scheduler_revised")),
        "passes": loop.passes,
        "open_files": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None,
        "loop": loop.stats(),
    }


def _submit(c: Client, futures: int, sessions: int, phase: str, duration: float, open_sessions: ExitStack) -> list:
    """``futures`` tasks, ``futures // sessions`` per session, one ``c.map`` each.

    The sessions stay open (entered on ``open_sessions``, the innermost one annotating
    each map) until the caller closes them: live workflow requests, and none can end
    while the scheduler is still building the graphs submitted before it.
    """
    per, out, t0 = futures // sessions, [], time.perf_counter()
    for sid in range(sessions):
        r = tuple(ROLES)[sid % len(ROLES)]
        restricted = phase == PHASES[0]
        keys = [f"{r if restricted else 'job'}-{sid}-{j}" for j in range(per)]
        open_sessions.enter_context(kvs.session(f"scale-{sid}", client=c))
        out += c.map(gated, [duration] * per, range(per), key=keys, resources=role(r) if restricted else None)
        if (sid + 1) % max(sessions // 10, 1) == 0:
            print(f"  submitted {len(out)}/{futures} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return out


async def scale_point(
    futures: int, sessions: int, workers: int, phase: str, *, seconds: float = 10.0, drain: float = 0.2
) -> dict:
    """One measurement: ``futures`` queued over ``sessions`` on ``workers``, every policy on, in ``phase``."""
    duration = max(0.5, workers * seconds / (drain * futures))
    settings: dict = {f"kvstate.scheduling.{k}": v for k, v in CONFIGS["all"].items()}
    settings["kvstate.lifecycle.enabled"] = True
    settings.update(HARNESS)
    GATE.clear()
    async with policy_cluster(spec(workers), settings) as c:
        await c.register_plugin(KVLifecycle())  # model=False leaves it out: see the module doc
        await c.register_plugin(KVLifecycleWorkerPlugin())
        t0, open_sessions = time.perf_counter(), ExitStack()
        fs = _submit(c, futures, sessions, phase, duration, open_sessions)
        while (await c.run_on_scheduler(_state))["tasks"] < len(fs):
            await asyncio.sleep(0.2)
        await c.run_on_scheduler(_emulate_reports)
        before = await c.run_on_scheduler(_state, reset=True)
        print(f"  all on the scheduler in {time.perf_counter() - t0:.0f}s; {before['open_files']} files open")
        GATE.set()
        await asyncio.sleep(seconds)
        after = await c.run_on_scheduler(_state)
        loop = after.pop("loop")
        row = {
            "futures": futures,
            "sessions": sessions,
            "workers": workers,
            "phase": phase,
            "task_seconds": duration,
            "seconds": seconds,
            "passes": loop["total"].get("count", 0),
            "completed": after["completed"] - before["completed"],
            "revised": after["revised"] - before["revised"],
            "queued_at_start": before["queued_on_scheduler"] + before["queued_on_workers"],
            "queued_at_end": after["queued_on_scheduler"] + after["queued_on_workers"],
            "loop": {k: v for k, v in loop.items() if k in ("total", *POLICIES)},
        }
        print(f"  {row['passes']} passes, total {_cell(row['loop']['total'])} ms; {json.dumps(row)}", flush=True)
        await c.run_on_scheduler(_unhook_invalidations)
        open_sessions.close()
        await c.cancel(fs)
    return row


def _cell(stats: dict) -> str:
    if not stats.get("count"):
        return "-"
    return f"{stats['p50_ms']:.2f} / {stats['p99_ms']:.2f} / {stats['max_ms']:.2f}"


def table(rows: list[dict]) -> str:
    """The scale table: per policy and in total P50 / P99 / max ms, and the P99 per queued future.

    >>> print(table([]).splitlines()[0].split(" | ")[:3])
    ['| futures', 'sessions', 'workers']
    """
    head = ["futures", "sessions", "workers", "phase", "passes", "completed", "revised"]
    head += [f"{p} ms" for p in POLICIES] + ["total P50 / P99 / max ms", "P99 µs per future"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        total = r["loop"]["total"]
        per_future = f"{1e3 * total['p99_ms'] / r['futures']:.3f}" if total.get("count") else "-"
        cells = [r["futures"], r["sessions"], r["workers"], r["phase"], r["passes"], r["completed"], r["revised"]]
        cells += [_cell(r["loop"].get(p, {})) for p in POLICIES] + [_cell(total), per_future]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """P50 and P99 of the whole pass against queued futures, log-log, per phase, with the 50 ms line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for phase, marker in zip(PHASES, "os"):
        pts = sorted((r["futures"], r["loop"]["total"]) for r in rows if r["phase"] == phase and r["passes"])
        xs = [x for x, _ in pts]
        for q, style in (("p99_ms", "-"), ("p50_ms", "--")):
            ax.plot(xs, [t[q] for _, t in pts], style, marker=marker, label=f"{q[:3].upper()}, {phase}")
    ax.axhline(LIMIT_MS, color="red", linewidth=1, label=f"{LIMIT_MS:.0f} ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("queued futures")
    ax.set_ylabel("control loop pass (ms)")
    ax.set_title("control loop pass vs queue, every policy on")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(rows: list[dict], out: str, seconds: float) -> None:
    """Print the table; write ``<out>/control_loop_scale.md``, ``.json`` and ``.png``."""
    md = table(rows)
    print(md)
    os.makedirs(out, exist_ok=True)
    sizes = ",".join(str(n) for n in sorted({r["futures"] for r in rows}))
    with open(os.path.join(out, "control_loop_scale.md"), "w") as f:
        f.write(
            f"Command: python -m dask_kvstate.bench nalar-workflows --control-loop-scale {sizes}; every policy on "
            f"(priority, stealing, capacity, lifecycle); {seconds:.0f} s measured per point after every future "
            "reached the scheduler; cells are P50 / P99 / max ms per pass (capacity runs every other pass). "
            f"See dask_kvstate/bench/nalar/loop_scale.py for the trickle of completions.\n\n{md}\n"
        )
    with open(os.path.join(out, "control_loop_scale.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(out, "control_loop_scale.png"))


def measure_control_loop_scale(
    sizes=SIZES, out: str = "results/nalar", *, sessions: int = 1000, workers: int = 100, seconds: float = 10.0
) -> list[dict]:
    """Every size in both phases; writes ``<out>/control_loop_scale.md``, ``.json`` and ``.png``."""
    rows = []
    for n in sizes:
        for phase in PHASES:
            print(f"{n} futures, {min(sessions, n)} sessions, {workers} workers: {phase}", flush=True)
            row = asyncio.run(scale_point(n, min(sessions, n), workers, phase, seconds=seconds))
            rows.append(row)
    write(rows, out, seconds)
    return rows
