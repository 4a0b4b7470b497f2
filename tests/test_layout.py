"""The layout's promise: the core, the compiler and every scheduler extension import and
run in a process where torch cannot be imported at all, as on a scheduler."""

from __future__ import annotations

import subprocess
import sys

WITHOUT_TORCH = """
import importlib, pkgutil, sys
sys.modules["torch"] = None  # from here on, any import of torch raises ImportError

import dask
import dask_kvstate as kvs
import dask_kvstate.plugins
import dask_kvstate.plugins.scheduler as scheduler_side
from dask_kvstate import extensions
from dask_kvstate.testing import shapes

for module in pkgutil.iter_modules(scheduler_side.__path__):
    importlib.import_module(f"dask_kvstate.plugins.scheduler.{module.name}")
# Every extension and worker half the installer would register, built here.
built = extensions.extensions(extensions.enabled(scheduling=True, lifecycle=True))
print("extensions", len(built.scheduler), len(built.worker))

# The compiler pass, as the scheduler runs it under a Client.
outs = shapes.tree_of_thought(k=3, n=4)
everything = dask.delayed(list)(outs)
graph = kvs.optimize(everything.__dask_graph__(), [everything.key])
inserted = [k for k in graph.to_dict() if str(k).startswith("kvs-materialize-")]
print("materialize", len(inserted))
print("plan", kvs.explain(*outs).plan.states and "states")
"""


def test_core_compiler_and_scheduler_side_run_without_torch():
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    n_scheduler, n_worker = map(int, lines["extensions"].split())
    assert n_scheduler >= 7 and n_worker == 2  # placement, observe, sessions, 4 policies, lifecycle; 2 halves
    assert int(lines["materialize"]) == 1  # the three thoughts share one inserted state
    assert lines["plan"] == "states"
