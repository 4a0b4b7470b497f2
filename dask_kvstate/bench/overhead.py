"""Experiment 5b: what the plugins cost a Dask graph with no LLM in it.

The same graph of tiny Python tasks on a plain cluster and on one with the plugins
(and the compiler), side by side; wall time and the scheduler's and workers' CPU seconds.
It starts its own clusters, since what it varies is the cluster itself.
"""

from __future__ import annotations

import os
import statistics
import time

import dask


def _inc(x):
    return x + 1


def _add(a, b):
    return a + b


def non_llm_graph(tasks: int, salt: str = ""):
    """A ``tasks``-task delayed graph of tiny Python tasks: a map, then a pairwise reduction.

    ``salt`` goes into every key, so a repeated run recomputes instead of finding results.
    """
    leaves = [dask.delayed(_inc, pure=True)(i, dask_key_name=f"inc-{salt}-{i}") for i in range(tasks // 2)]
    level = 0
    while len(leaves) > 1:
        level += 1
        leaves = [
            dask.delayed(_add, pure=True)(*leaves[i : i + 2], dask_key_name=f"add-{salt}-{level}-{i}")
            if i + 1 < len(leaves)
            else leaves[i]
            for i in range(0, len(leaves), 2)
        ]
    return leaves[0]


def _cpu_seconds(dask_scheduler=None, dask_worker=None) -> float:
    """CPU time of this process, all threads (the scheduler materialises graphs in a thread)."""
    return time.process_time()


def _scheduler_tasks(dask_scheduler) -> int:
    return len(dask_scheduler.tasks)


def _wait_idle(client, timeout: float = 120.0) -> None:
    """Until the scheduler holds no task: the last run's keys are forgotten everywhere.

    Releasing 10,000 keys costs the scheduler and workers as much CPU as a good part of a
    run; without this wait it overlapped the next timed run (on the same scheduler for
    the compiler column), so the columns did not pay for it alike.
    """
    deadline = time.monotonic() + timeout
    while client.run_on_scheduler(_scheduler_tasks) and time.monotonic() < deadline:
        time.sleep(0.05)


def _cpu(client) -> tuple[float, float]:
    return client.run_on_scheduler(_cpu_seconds), sum(client.run(_cpu_seconds).values())


def overhead(model: str, tasks: int, repeats: int, bar) -> dict:
    """Experiment 5b: the same non-LLM graph on a plain cluster and on one with the plugins.

    Runs alternate between the two clusters (both up at once, same shape), so load
    drifts on this shared machine hit both alike; medians are compared. The third
    column also turns the compiler on (its pass then runs on every compute). Each round
    rotates the order of the columns, and each run starts on an idle cluster (the last
    run's keys forgotten), so no column always follows another's clean-up. Besides wall
    time, each run records the CPU seconds the scheduler and the workers spent on it
    (process time, all threads), which another engineer's load on the machine moves
    much less than the wall clock. A LocalCluster runs its scheduler in the calling
    process, so "scheduler" CPU is that process: both schedulers (the idle one costs
    ~0.03 s per second), the clients and the graph's submission, alike for every column.
    """
    from distributed import Client, LocalCluster

    import dask_kvstate as kvs

    expected = sum(range(1, tasks // 2 + 1))
    opts = {"n_workers": 2, "threads_per_worker": 1, "processes": True, "dashboard_address": ":0"}
    names = ("plain", "plugins", "plugins+compiler")
    load_start = [round(x, 2) for x in os.getloadavg()]
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, dict[str, list[float]]] = {k: {"scheduler": [], "workers": []} for k in names}
    with (
        LocalCluster(**opts) as c1,
        Client(c1, set_as_default=False) as plain,
        LocalCluster(**opts) as c2,
        Client(c2, set_as_default=False) as ours,
    ):
        kvs.install(ours, model, torch_threads=1)
        clients = {"plain": plain, "plugins": ours, "plugins+compiler": ours}
        n_tasks = len(non_llm_graph(tasks).__dask_graph__())
        for i in range(repeats + 1):  # the first round warms both up and is not counted
            for name in names[i % 3 :] + names[: i % 3]:
                client = clients[name]
                bar.set_postfix_str(f"overhead {name}")
                graph = non_llm_graph(tasks, f"{name}-{i}")
                _wait_idle(client)
                s0, w0 = _cpu(client)
                with kvs.stateflow() if name.endswith("compiler") else dask.config.set({}):
                    t0 = time.perf_counter()
                    future = client.compute(graph)
                    got = future.result()
                    dt = time.perf_counter() - t0
                del future
                _wait_idle(client)  # the release is part of the run's CPU, not of the next one's
                s1, w1 = _cpu(client)
                assert got == expected, f"the {name} run returned {got}, expected {expected}"
                if i:
                    times[name].append(dt)
                    cpu[name]["scheduler"].append(s1 - s0)
                    cpu[name]["workers"].append(w1 - w0)
            bar.update()
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: {part: statistics.median(v) for part, v in parts.items()} for k, parts in cpu.items()}
    return {
        "tasks": n_tasks,
        "repeats": repeats,
        "times_s": times,
        "median_s": med,
        "spread_s": {k: [min(v), max(v)] for k, v in times.items()},
        "cpu_s": cpu,
        "cpu_median_s": cpu_med,
        "scheduler_us_per_task": {k: 1e6 * v["scheduler"] / n_tasks for k, v in cpu_med.items()},
        "worker_us_per_task": {k: 1e6 * v["workers"] / n_tasks for k, v in cpu_med.items()},
        "scheduler_cpu_overhead_pct": 100 * (cpu_med["plugins"]["scheduler"] / cpu_med["plain"]["scheduler"] - 1),
        "worker_cpu_overhead_pct": 100 * (cpu_med["plugins"]["workers"] / cpu_med["plain"]["workers"] - 1),
        "load_average": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
        "overhead_pct": 100 * (med["plugins"] / med["plain"] - 1),
        "overhead_with_compiler_pct": 100 * (med["plugins+compiler"] / med["plain"] - 1),
    }
