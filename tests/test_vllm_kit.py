"""The conformance kit's families on the vLLM backend, each against its own replay and
transformers' ``generate`` (one engine at a time: vLLM keeps one connector per process).

Skips, saying why, where vLLM is not installed (the ``vllm`` extra).
"""

from __future__ import annotations

import dask
import pytest
import torch

from .test_vllm import GREEDY, pytestmark  # noqa: F401  (the same skip and marks)

# The conformance kit's full-attention families (vLLM frees sliding layers' blocks; the
# backend refuses those), at 32-dim heads: vLLM's CPU attention serves no narrower.
KIT_FAMILIES = ["llama", "qwen3", "granite", "cohere", "mixtral", "qwen3_moe"]
# vLLM's own replay of these differs from transformers' generate (engine against engine, not
# reuse against replay, which the test checks for them too): Cohere from its first token on.
REPLAY_DIFFERS_FROM_TRANSFORMERS = {"cohere"}


@pytest.mark.parametrize("family", KIT_FAMILIES)
def test_kit_family_on_vllm(family, tmp_path_factory):
    from dask_kvstate.backends import load_backend
    from dask_kvstate.testing import architectures

    folder = architectures.build(family, tmp_path_factory.getbasetemp() / "kit", wide=True)
    model, _ = architectures.model(architectures.widened(architectures.FAMILIES[family]))
    with dask.config.set({"kvstate.backend": "vllm", "kvstate.block-tokens": 32}):
        backend = load_backend(str(folder))
    try:
        prefix = "The planner reads the task and writes a plan; the developer writes the code. " * 3
        ids = backend.tokenize(prefix)
        kv = backend.kv_from_cache(backend.prefill(ids)[0])
        for suffix in (" The tester", " Then what failed was"):
            full = backend.tokenize(prefix + suffix)
            keep = min(len(ids), len(full)) - 1
            backend.reset_engine_cache()
            replay = backend.generate(full, None, GREEDY)
            backend.reset_engine_cache()
            resumed = backend.generate(full, kv[:, :, :, :keep], GREEDY)
            assert resumed.token_ids == replay.token_ids, family
            assert resumed.reused_tokens == keep
            with torch.inference_mode():
                want = model.generate(torch.tensor([full]), max_new_tokens=16, do_sample=False)[0, len(full) :]
            same_as_transformers = replay.token_ids == want.tolist()[: len(replay.token_ids)]
            assert same_as_transformers != (family in REPLAY_DIFFERS_FROM_TRANSFORMERS), family
    finally:
        backend.close()
