"""Deployment as on many machines: ``dask scheduler`` and ``dask worker`` processes with the preload.

No ``kvs.install`` here: the workers get their model from ``--preload dask_kvstate.plugins``
and ``DASK_KVSTATE__*`` environment variables, as under dask-jobqueue or Kubernetes.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import dask
from distributed import Client, Scheduler, Worker
from distributed.utils_test import captured_logger

import dask_kvstate as kvs
from dask_kvstate.graph_opt import recent_plans
from dask_kvstate.testing import shapes

from .conftest import CONTEXT, compute_released, on

ENV = {
    "DASK_KVSTATE__MODEL": "tiny-llama",
    "DASK_KVSTATE__BLOCK_TOKENS": "16",
    "DASK_KVSTATE__WORKER__TORCH_THREADS": "1",
    "DASK_KVSTATE__PLACEMENT__RULE": "pull",
    "HF_HUB_OFFLINE": "1",
}


def test_cli_cluster_with_the_preload_runs_the_compiler_and_moves_state(tmp_path):
    # `python -m dask` is the `dask` CLI of this very interpreter (a copied venv's
    # `bin/dask` may carry another interpreter's shebang).
    dask_cli = [sys.executable, "-m", "dask"]
    env = {**os.environ, **ENV}
    sched_file = tmp_path / "scheduler.json"
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("scheduler", "worker-0", "worker-1")}
    procs = [
        subprocess.Popen(
            [
                *dask_cli,
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                str(sched_file),
                "--preload",
                "dask_kvstate.plugins",
            ],
            env=env,
            cwd=tmp_path,
            stdout=logs["scheduler"],
            stderr=subprocess.STDOUT,
        )
    ]
    try:
        for i in range(2):  # both the workers and the Client wait for the scheduler file to appear
            procs.append(
                subprocess.Popen(
                    [
                        *dask_cli,
                        "worker",
                        "--scheduler-file",
                        str(sched_file),
                        "--host",
                        "127.0.0.1",
                        "--nthreads",
                        "1",
                        "--no-dashboard",
                        "--local-directory",
                        str(tmp_path / f"w{i}"),
                        "--preload",
                        "dask_kvstate.plugins",
                        "--preload-nanny",
                        "dask_kvstate.plugins",
                    ],
                    env=env,
                    cwd=tmp_path,
                    stdout=logs[f"worker-{i}"],
                    stderr=subprocess.STDOUT,
                )
            )
        with Client(scheduler_file=str(sched_file), timeout=60) as c:
            c.wait_for_workers(2, timeout=120)
            a, b = sorted(c.nthreads())
            assert a.startswith("tcp://127.0.0.1:")
            # The preload alone installed the model and the scheduler's placement extension.
            assert {s["installed"] for s in kvs.stats(c).workers.values()} == {True}
            assert {tuple(s["models"]) for s in kvs.stats(c).workers.values()} == {("tiny-llama",)}
            # (a lambda: cloudpickle sends it by value; this test module is not importable over there)
            seen = c.run(
                lambda dask_worker: (
                    dask_worker.plugins["kvstate"].runtime.block_tokens,
                    dask_worker.plugins["kvstate"].placement,
                )
            )
            assert set(seen.values()) == {(16, True)}
            # And every process's Dask timers slowed (plugins/housekeeping.py): 1 s ticks against 20 ms.
            ticks = lambda dask_worker=None, dask_scheduler=None: (
                (dask_worker or dask_scheduler).periodic_callbacks["tick"].callback_time
            )
            assert set(c.run(ticks).values()) == set(c.run(ticks, nanny=True).values()) == {1000}
            assert c.run_on_scheduler(ticks) == 1000
            assert kvs.stats(c).placement["installed"]

            # The compiler pass, on the scheduler process.
            off = compute_released(*shapes.tree_of_thought(k=3, n=6))
            with kvs.stateflow():
                on_ = dask.compute(*shapes.tree_of_thought(k=3, n=6))
            assert [o.token_ids for o in on_] == [o.token_ids for o in off]
            assert any(p["states"] == 1 and p["resumes"] == 3 for p in c.run_on_scheduler(recent_plans))

            # A cross-worker workflow: prefill on a, resume on b over the CLI cluster's comm.
            with on(a):
                state = kvs.materialize(CONTEXT)
            with on(b):
                out = kvs.resume(state, " Who tests?", max_new_tokens=12)
            ref, got = dask.compute(state, out)
            want = c.compute(kvs.generate(CONTEXT, " Who tests?", max_new_tokens=12)).result()
            assert got.token_ids == want.token_ids
            assert kvs.stats(c).workers[b]["transfers"] == len(ref.blocks)

            c.shutdown()  # scheduler and workers close themselves
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()
    text = {name: (tmp_path / f"{name}.log").read_text() for name in logs}
    assert codes == [0, 0, 0], text
    # No error of ours. (distributed itself may log closing streams, or a nanny's watcher
    # thread racing its queue's close, while the processes exit 0 all the same.)
    for t in text.values():
        errors = [line for line in t.splitlines() if " ERROR " in line or "Exception in callback" in line]
        assert "Failed to start preload" not in t and not [e for e in errors if "kvstate" in e.lower()], errors


def test_a_bad_setting_fails_the_preload_loudly_with_its_name():
    # In-process servers in their own event loop (gen_cluster's leak checks would trip
    # over the session cluster's processes).
    async def start_worker():
        async with Scheduler(port=0, dashboard_address=":0") as s:
            async with Worker(s.address, nthreads=1, preload=["dask_kvstate.plugins"]) as w:
                return set(w.plugins)

    with dask.config.set({"kvstate.worker.disk-bytes": "lots"}), captured_logger("distributed.preloading") as log:
        plugins = asyncio.run(start_worker())
    assert "kvstate" not in plugins  # no half-configured plugin
    assert "Failed to start preload: dask_kvstate.plugins" in log.getvalue()
    assert "kvstate.worker.disk-bytes must be a byte size like '16GiB', got 'lots'" in log.getvalue()
