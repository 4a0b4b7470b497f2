"""How a worker's vLLM engine is set up before vLLM reads its environment.

A compiled engine (``kvstate.vllm.compile: true``) must load what an earlier start
compiled: vLLM's CPU build cannot load its own AOT artifacts back, so the engine uses
torch's inductor cache instead, unless the user chose AOT compilation themselves.
(Measured through a worker: a compiled engine's install and first generate 23.7-23.9 s
with it, 59.1 s with AOT: docs/guide/backends.md.) A compile that fails starts the engine
eager instead.
"""

from __future__ import annotations

import os

from dask_kvstate.backends.vllm_start import use_inductor_cache

from .conftest import SPAWNED, transformers_continuation, vllm_prompts, vllm_test


def test_a_compiled_engine_reuses_the_inductor_cache(monkeypatch):
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    use_inductor_cache()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"


def test_a_users_own_choice_of_aot_compilation_is_kept(monkeypatch):
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    use_inductor_cache()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1"


@vllm_test
def test_an_engine_whose_compile_fails_starts_eager_and_answers_as_transformers():
    """A worker without a working C++ compiler (``CXX`` pointing nowhere, every compile cache
    off, so inductor must build its kernels): the default, compiled start fails for real,
    on inductor's own compiler lookup before a minute of tracing, the engine starts eager
    instead, says so in ``kvs.stats``, and answers as transformers' own ``generate`` does."""
    import dask
    from distributed import Client, LocalCluster

    import dask_kvstate as kvs
    from dask_kvstate.backends import models
    from dask_kvstate.bench import workload

    no_compiler = {
        "CXX": "/nonexistent/c++",
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
        "VLLM_DISABLE_COMPILE_CACHE": "1",
    }
    prefix, suffix = vllm_prompts()[0]
    config = {**SPAWNED, "kvstate.vllm.compile": True, "kvstate.block-tokens": 64}
    with (
        dask.config.set(config),
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0", env=no_compiler
        ) as cluster,
        Client(cluster) as client,
    ):
        kvs.install(client, "smollm2-135m", backend="vllm")
        got = kvs.generate(prefix, suffix, max_new_tokens=8).compute()
        engines = [s["engine"] for s in kvs.stats(client).workers.values()]
    assert [e["compiled"] for e in engines] == [False]
    model, _ = models.load("smollm2-135m", dtype="float32")
    ids = workload.tokenizer_of("smollm2-135m")(prefix + suffix)
    assert got.token_ids == transformers_continuation(model, ids, 8)[: len(got.token_ids)]
