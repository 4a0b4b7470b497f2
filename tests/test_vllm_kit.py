"""The conformance kit's families on the vLLM backend, each against its own replay and
transformers' ``generate`` (one engine at a time: vLLM keeps one connector per process).

Skips, saying why, where vLLM is not installed (the ``vllm`` extra).
"""

from __future__ import annotations

import dask
import pytest
import torch

from dask_kvstate.generation import Sampling

from .test_vllm import GREEDY, pytestmark  # noqa: F401  (the same skip and marks)

# The conformance kit's families with a full-attention layer, sliding ones beside it included
# (vLLM allocates those as full attention under kvstate's connector; a model whose every layer
# slides, it frees their blocks below the window, so the backend refuses it), at 32-dim heads:
# vLLM's CPU attention serves no narrower. Not the kit's gemma2 (vLLM's Gemma 2 takes tied
# embeddings only) nor its qwen2 (vLLM refuses sliding on some of its layers): vLLM's own limits.
KIT_FAMILIES = ["llama", "qwen3", "granite", "cohere", "mixtral", "qwen3_moe", "gemma3"]
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


def test_gemma3_270m_past_its_window_resumes_as_replay_and_hands_its_answers_kv(tmp_path):
    """The real Gemma 3 270M (15 sliding layers, window 512, 3 full): a state of ~1,500
    tokens, three times the window, loaded into the engine resumes token for token as text
    replay, which equals transformers' ``generate``; the KV of a prompt and its answer
    handed out equals a prefill of the same ids: every layer keeps every token. Each
    generation follows NaN left in the attention kernel's scratch memory, which a decode
    past the window split across threads used to merge (``plan_mixed_windows_unsplit``)."""
    from dask_kvstate.backends import load_backend, models

    from .conftest import vllm_prompts

    parts = vllm_prompts()
    prefix = parts[0][0] * 3
    sampling = Sampling(max_new_tokens=12, temperature=0.0, top_p=1.0, seed=None)
    with dask.config.set({"kvstate.backend": "vllm", "kvstate.block-tokens": 64}):
        backend = load_backend("gemma3-270m")
    model, _ = models.load("gemma3-270m", dtype="float32")
    try:
        ids = backend.tokenize(prefix)
        assert len(ids) > 2 * 512
        kv = backend.kv_from_cache(backend.prefill(ids)[0])
        assert kv.shape[0] == 18 and kv.shape[3] == len(ids)  # every layer, every token
        for i, (_, suffix) in enumerate(parts[:2]):
            full = backend.tokenize(prefix + suffix)
            keep = len(ids) - 1
            assert full[:keep] == ids[:keep]
            backend.reset_engine_cache()
            _leave_nan_in_the_kernels_scratch(backend, len(full))
            replay = backend.generate(full, None, sampling)
            backend.reset_engine_cache()  # nothing left in the engine: the state's blocks are loaded
            _leave_nan_in_the_kernels_scratch(backend, len(full))
            resumed = backend.generate(full, kv[:, :, :, :keep], sampling)
            assert resumed.token_ids == replay.token_ids and resumed.reused_tokens == keep
            if i == 0:  # the engine's replay is transformers' own: once (a 1,500-token generate is slow here)
                with torch.inference_mode():
                    want = model.generate(torch.tensor([full]), max_new_tokens=12, do_sample=False)[0, len(full) :]
                assert replay.token_ids == want.tolist()[: len(replay.token_ids)]
        backend.reset_engine_cache()
        handed: list = []
        full = backend.tokenize(prefix + parts[0][1])
        _leave_nan_in_the_kernels_scratch(backend, len(full))
        got = backend.generate(full, None, sampling, on_sequence=lambda c, s: handed.append((c, s)))
        ((cache, seq),) = handed
        assert seq == full + got.token_ids[:-1]
        backend.reset_engine_cache()
        whole = backend.kv_from_cache(backend.prefill(seq)[0])
        torch.testing.assert_close(backend.kv_from_cache(cache), whole, atol=2e-3, rtol=1e-3)
    finally:
        backend.close()


def _leave_nan_in_the_kernels_scratch(backend, tokens: int) -> None:
    """NaN in vLLM's CPU attention scratch memory, as an earlier computation of a long-lived
    process may leave it: a decode over NaN queries and ``tokens`` keys, planned and split as
    the engine's threads would split one (run on the engine's own thread, so with its team)."""
    from vllm import _custom_ops as ops

    from dask_kvstate.backends.cpu_attention import PAGE_TOKENS, _isa

    heads, kv_heads, dim = backend.config.num_attention_heads, backend.kv_heads, backend.head_dim
    pages = -(-tokens // PAGE_TOKENS)
    key_pages, value_pages = torch.zeros((pages, kv_heads, 2 * PAGE_TOKENS, dim)).chunk(2, dim=2)
    starts, lengths = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    isa = _isa(torch.float32, dim)

    def decode(_engine) -> bool:
        plan = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lengths,
            dtype=torch.float32, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=True,
        )  # fmt: skip
        out = torch.zeros((1, heads, dim))
        ops.cpu_attention_with_kv_cache(
            query=torch.full((1, heads, dim), float("nan")), key_cache=key_pages, value_cache=value_pages,
            output=out, query_start_loc=starts, seq_lens=lengths, scale=dim**-0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=torch.arange(pages, dtype=torch.int32)[None],
            softcap=0.0, scheduler_metadata=plan, s_aux=None,
        )  # fmt: skip
        return bool(out.isnan().all())

    assert backend.loop.call(decode)


def test_the_connector_finds_layers_vllm_keeps_a_window_of_blocks_for():
    """What the connector refuses to start on (defence behind the backend's own check): a
    layer vLLM allocates with a window, whose blocks below it vLLM frees."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from dask_kvstate.backends.vllm_connector import _windowed_layers

    shape = {"block_size": 64, "num_kv_heads": 1, "head_size": 32, "dtype": torch.float32}
    full, sliding = FullAttentionSpec(**shape), SlidingWindowSpec(**shape, sliding_window=24)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]

    def config(*groups):
        return KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(*g) for g in groups])

    assert _windowed_layers(config((names, full))) == [] and _windowed_layers(None) == []
    assert _windowed_layers(config((names[:1], full), (names[1:], sliding))) == names[1:]
