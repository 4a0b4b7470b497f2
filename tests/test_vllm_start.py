"""How a worker's vLLM engine is set up before vLLM reads its environment.

A compiled engine (``kvstate.vllm.compile: true``) must load what an earlier start
compiled: vLLM's CPU build cannot load its own AOT artifacts back, so the engine uses
torch's inductor cache instead, unless the user chose AOT compilation themselves.
(Measured through a worker: a compiled engine's install and first generate 23.7-23.9 s
with it, 59.1 s with AOT: docs/guide/backends.md.)
"""

from __future__ import annotations

import os

from dask_kvstate.backends.vllm_start import use_inductor_cache


def test_a_compiled_engine_reuses_the_inductor_cache(monkeypatch):
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    use_inductor_cache()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"


def test_a_users_own_choice_of_aot_compilation_is_kept(monkeypatch):
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    use_inductor_cache()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1"
