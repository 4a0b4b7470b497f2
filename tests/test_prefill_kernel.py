"""A prompt's attention over itself through vLLM's CPU kernel on the transformers backend
(``backends/prefill_kernel.py``): the kernel against sdpa, when it is used and when not, and
models served with it against transformers' own ``generate``.

Skips, saying why, where vLLM is not installed (the ``vllm`` extra): the backend then keeps sdpa.
"""

from __future__ import annotations

import threading

import dask
import pytest
import torch
import torch.nn.functional as F

from dask_kvstate.backends.hf import HFBackend
from dask_kvstate.backends.prefill_kernel import PrefillKernel
from dask_kvstate.generation import Sampling

from .conftest import transformers_continuation, vllm_missing

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's


def sdpa(q, k, v):
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
    return out.transpose(1, 2)


def qkv(B, T, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn((B, HEADS, T, DIM), generator=g).to(dtype),
        torch.randn((B, KV_HEADS, T, DIM), generator=g).to(dtype),
        torch.randn((B, KV_HEADS, T, DIM), generator=g).to(dtype),
    )


@pytest.fixture(scope="module")
def kernel():
    kernel, why = PrefillKernel.load(HEADS, KV_HEADS, DIM, torch.float32)
    assert kernel is not None, why
    return kernel


@pytest.mark.parametrize("B, T", [(1, 1), (1, 63), (1, 64), (1, 65), (2, 300), (1, 1100)])
def test_the_kernel_computes_causal_attention_as_sdpa_does(kernel, B, T):
    q, k, v = qkv(B, T)
    got = kernel(q, k, v, None)
    assert got.shape == (B, T, HEADS, DIM)
    torch.testing.assert_close(got, sdpa(q, k, v), atol=2e-5, rtol=1e-4)
    # The module's own scale is honoured.
    torch.testing.assert_close(
        kernel(q, k, v, 0.05),
        sdpa(q * (0.05 * DIM**0.5), k, v),
        atol=2e-5,
        rtol=1e-4,
    )


def test_bfloat16_too():
    kernel, why = PrefillKernel.load(HEADS, KV_HEADS, DIM, torch.bfloat16)
    assert kernel is not None, why
    q, k, v = qkv(1, 200, torch.bfloat16)
    torch.testing.assert_close(kernel(q, k, v, None).float(), sdpa(q, k, v).float(), atol=3e-2, rtol=3e-2)


def test_heads_it_cannot_serve_are_refused_naming_why():
    assert PrefillKernel.load(9, 3, 16, torch.float32) == (None, "head size 16 is not one vLLM's CPU kernel supports")
    kernel, why = PrefillKernel.load(9, 4, 64, torch.float32)
    assert kernel is None and "do not group" in why


class Module:
    is_causal = True


def test_it_applies_only_to_a_prompt_attending_over_itself(kernel):
    q, k, v = qkv(1, 40)
    m = Module()
    assert kernel.applies(m, q, k, None, {"scaling": 0.125})
    assert kernel.applies(m, q, k, None, {"sliding_window": 40})  # a window the prompt fits in cuts nothing
    past_k = torch.cat([k, k], dim=2)
    refused = [
        (q, k, torch.ones(1, 1, 40, 40, dtype=torch.bool), {}),  # a mask: padding, or a window that cuts
        (q, past_k, None, {}),  # a past: the keys outnumber the queries
        (q, k, None, {"sliding_window": 39}),
        (q, k, None, {"softcap": 30.0}),
        (q, k, None, {"s_aux": torch.zeros(HEADS)}),
        (q, k, None, {"dropout": 0.1}),
        (q, k, None, {"is_causal": False}),  # bidirectional
        (q.to(torch.bfloat16), k.to(torch.bfloat16), None, {}),  # not the dtype it was loaded for
        (q[:, :8], k, None, {}),  # other heads
    ]
    for query, key, mask, kwargs in refused:
        assert not kernel.applies(m, query, key, mask, kwargs), kwargs or (query.shape, key.shape, mask is not None)


def test_a_thread_of_another_team_size_gets_its_own_plan(kernel):
    """The kernel refuses a work plan made for another OpenMP team size: plans are per thread and size."""
    q, k, v = qkv(1, 130)
    want = kernel(q, k, v, None)
    got = {}

    def one_thread():
        torch.set_num_threads(1)
        got["out"] = kernel(q, k, v, None)

    t = threading.Thread(target=one_thread)
    t.start()
    t.join()
    torch.testing.assert_close(got["out"], want, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def smollm2():
    return HFBackend.load("smollm2-135m")


def test_smollm2_with_the_kernel_replays_as_transformers_generates(smollm2):
    """Text replay (the kernel's prefill) and a resume against transformers' own generate on a
    fresh model (sdpa): token for token."""
    from dask_kvstate.backends.models import load
    from dask_kvstate.bench.workload import context_text, suffix

    assert smollm2.prefill_kernel is not None, smollm2.prefill_kernel_note
    fresh, _ = load("smollm2-135m")
    before = smollm2.prefill_kernel.calls
    for i in range(2):
        ids = smollm2.tokenize(context_text(6) + suffix(i))
        replay = smollm2.generate(ids, None, Sampling(max_new_tokens=16))
        assert replay.token_ids == transformers_continuation(fresh, ids, 16)[: len(replay.token_ids)]
        kv = smollm2.kv_from_cache(smollm2.prefill(ids[: len(ids) * 3 // 4])[0])
        assert smollm2.generate(ids, kv, Sampling(max_new_tokens=16)).token_ids == replay.token_ids
    assert smollm2.prefill_kernel.calls > before
    assert smollm2.engine_stats()["prefill_kernel_layers"] == smollm2.prefill_kernel.calls


def test_switched_off_sdpa_stays_and_the_fingerprint_says_so(smollm2):
    with dask.config.set({"kvstate.hf.prefill-kernel": False}):
        off = HFBackend.load("smollm2-135m")
    assert off.prefill_kernel is None
    assert off.engine_stats()["prefill_kernel"] == "kvstate.hf.prefill-kernel is off"
    assert off.config_fingerprint != smollm2.config_fingerprint  # states of the two never mix
    ids = off.tokenize("The planner reads the task and writes a plan.")
    assert off.generate(ids, None, Sampling(max_new_tokens=8)).token_ids == (
        smollm2.generate(ids, None, Sampling(max_new_tokens=8)).token_ids
    )


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "phi3"])
def test_families_served_with_the_kernel_replay_as_transformers_generates(family, tmp_path_factory):
    """Tiny models at 32-dim heads (the narrowest the kernel serves); Mistral and Phi-3 with a
    sliding window, which the kernel serves only where the prompt fits in it."""
    from dask_kvstate.testing import architectures

    folder = architectures.build(family, tmp_path_factory.getbasetemp() / "kit", wide=True)
    model, _ = architectures.model(architectures.widened(architectures.FAMILIES[family]))
    backend = HFBackend.load(str(folder))
    assert backend.prefill_kernel is not None, backend.prefill_kernel_note
    for text in ("The planner reads the task", "The planner reads the task and writes a plan; " * 6):
        ids = backend.tokenize(text)
        before = backend.prefill_kernel.calls
        replay = backend.generate(ids, None, Sampling(max_new_tokens=12))
        want = transformers_continuation(model, ids, 12)
        assert replay.token_ids == want[: len(replay.token_ids)], (family, len(ids))
        window = getattr(backend.config, "sliding_window", None)
        used = backend.prefill_kernel.calls > before
        assert used == (window is None or len(ids) <= window), (family, len(ids), window)


def test_a_model_on_eager_attention_keeps_it():
    """The kernel stands in for sdpa's causal case only: eager's mask is explicit, and eager may cap logits."""
    from dask_kvstate.testing import architectures

    model, tokenizer = architectures.model(architectures.widened(architectures.FAMILIES["llama"]))
    model.set_attn_implementation("eager")
    backend = HFBackend("llama-eager", model, tokenizer)
    assert backend.prefill_kernel is None
    assert backend.engine_stats()["prefill_kernel"] == "the model's attention is 'eager', not sdpa"
