"""``python -m dask_kvstate.bench <experiment> [flags]``: every measurement, every baseline really run.

One command for every experiment of the project, found by name (``--list``), its flags
generated from the experiment's ``Options`` (``<experiment> --help``); the scripts in
``examples/`` call it. :mod:`dask_kvstate.bench.registry` holds the list. The AAFLOW+
experiments (:mod:`dask_kvstate.bench.cli`) run text replay, a per-worker local prefix
cache and kvstate (compiler + stores + placement + batched siblings) side by side on one
cluster, one model and the same prompts; results go to a folder as markdown tables, JSON
and PNG plots.
"""

from __future__ import annotations

from dask_kvstate.bench.registry import EXPERIMENTS, main

__all__ = ["EXPERIMENTS", "main"]
