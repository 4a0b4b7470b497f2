"""The raw-engine baseline and KV beyond the engine's memory, end to end on SmolLM2.

A raw ``vllm.LLM`` in its own process against kvstate over vLLM with the same engine
memory, on sessions whose documents do not all fit in it: every output equal to the
raw engine's, the raw engine really evicted the documents, kvstate's returning visits
read them from its store's disk tier (its memory tiers hold one block each).

Skips, saying why, where vLLM is not installed (the ``vllm`` extra).
"""

from __future__ import annotations

import json

import dask
import pytest

from .conftest import SPAWNED, VLLM_TESTS

pytestmark = VLLM_TESTS


def test_unknown_model_is_refused_before_an_engine_starts():
    from dask_kvstate.bench.raw_vllm import RawEngine

    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        RawEngine("no-such-model")


def test_returning_sessions_read_their_kv_from_the_store_and_match_the_raw_engine(tmp_path):
    from dask_kvstate.bench import beyond_memory

    # Three ~600-token documents, an engine holding about two of them (the raw engine's
    # blocks are vLLM's default size, kvstate's 64 tokens; both round the memory down).
    # The memory tiers' row is the same path, read from RAM.
    opts = beyond_memory.small(variants=["raw-vllm-eager", "kvstate-disk"], out=str(tmp_path))
    # 64-token blocks (a size vLLM's CPU attention takes), whatever an earlier test left set
    with dask.config.set({"kvstate.block-tokens": 64, **SPAWNED}):
        res = beyond_memory.command(opts)
    rows = res["rows"]
    visits = opts.sessions * opts.rounds
    assert res["identical"] == dict.fromkeys(rows, f"{visits}/{visits}")
    raw = rows["raw-vllm-eager"][0]
    # The regime: the raw engine's prefix cache had lost most of each document when its session came back.
    assert all(x["reused_tokens"] < 300 for x in raw if x["round"] > 0), [x["reused_tokens"] for x in raw]
    back = [x for x in rows["kvstate-disk/vllm"][0] if x["round"] > 0]
    assert all(x["reused_tokens"] >= 512 for x in back)  # the document's whole blocks came from the store
    assert all("disk" in x["tiers"] for x in back), [x["tiers"] for x in back]  # spilled there, read back
    table = res["table"]
    assert set(table) == set(rows) and all(m["returning_speedup"] > 0 for m in table.values())
    assert json.loads((tmp_path / "beyond_memory.json").read_text())["identical"] == res["identical"]
    assert "| kvstate-disk/vllm |" in (tmp_path / "beyond_memory.md").read_text()
    assert (tmp_path / "beyond_memory.png").stat().st_size > 0
