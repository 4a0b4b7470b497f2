"""Doctest collection: modules that import an optional engine are collected only where it is installed."""

from __future__ import annotations

import importlib.util

collect_ignore = []
if importlib.util.find_spec("vllm") is None:  # the vllm extra: the backend's modules import vLLM itself
    collect_ignore += [f"dask_kvstate/backends/{m}.py" for m in ("vllm", "vllm_connector", "vllm_engine", "vllm_start")]
