"""``python -m dask_kvstate.bench``: the AAFLOW+ experiments, every baseline really run.

Text replay, a per-worker local prefix cache and kvstate (compiler + stores +
placement + batched siblings) run side by side on one cluster, one model and the same
prompts; results go to a folder as markdown tables, JSON and PNG plots. See
:mod:`dask_kvstate.bench.cli` for the options and the grids.
"""

from __future__ import annotations

from dask_kvstate.bench.cli import EXPERIMENTS, main

__all__ = ["EXPERIMENTS", "main"]
