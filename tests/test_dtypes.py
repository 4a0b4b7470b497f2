"""What is guaranteed per dtype (README, "Supported model families and dtypes").

* Every dtype, text replay: the tokens of transformers' own ``model.generate`` in that dtype.
* float32, every reuse path (a resume from a stored state, batched decode over a shared
  prefix): the same tokens.
* bfloat16 and float16, reuse paths: the same tokens except at a near-tie, where the
  reference's top two logits are within a few rounding steps of the dtype. A resume
  computes the prefix without the suffix in the same matmuls, and a batch merges two
  partial attentions, so the last bits differ; bfloat16 keeps 8 bits of mantissa.
  Measured on SmolLM2 by ``python -m dask_kvstate.bench.agreement``.
"""

from __future__ import annotations

import pytest
import torch

from dask_kvstate.backends.batch import Row, generate_batch
from dask_kvstate.backends.hf import HFBackend
from dask_kvstate.backends.models import load
from dask_kvstate.bench.agreement import first_difference
from dask_kvstate.bench.workload import context_text, suffix
from dask_kvstate.generation import Sampling

NEW = 12


@pytest.fixture(scope="module", params=["float32", "bfloat16", "float16"])
def backend(request):
    model, tokenizer = load("tiny-llama")
    return HFBackend("tiny-llama", model.to(getattr(torch, request.param)), tokenizer)


@pytest.fixture(scope="module")
def prompts(backend):
    context = backend.tokenize(context_text(4))
    return context, [context + backend.tokenize(suffix(i)) for i in range(4)]


def reference(backend, prompt):
    with torch.inference_mode():
        out = backend.model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt) :].tolist()


def assert_same_or_near_tie(backend, prompt, got: list[int], replay: list[int], path: str) -> None:
    at = first_difference(got, replay)
    if at is None:
        return
    assert backend.dtype != torch.float32, f"float32 {path} diverged from text replay at token {at}"
    with torch.inference_mode():
        logits = backend.model(torch.tensor([prompt + replay[:at]])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    # A few rounding steps of the dtype at the logits' magnitude.
    eps = torch.finfo(backend.dtype).eps
    assert float(top[0] - top[1]) <= 4 * eps * float(top[0].abs()), (
        f"{path} diverged at token {at} where the top two logits are {top.tolist()}: not a near-tie"
    )


def test_text_replay_equals_model_generate_in_the_same_dtype(backend, prompts):
    for prompt in prompts[1]:
        replay = backend.generate(prompt, None, Sampling(NEW)).token_ids
        assert replay == reference(backend, prompt)[: len(replay)]


def test_reuse_paths_differ_from_replay_only_at_near_ties(backend, prompts):
    context, rows = prompts
    state = backend.kv_from_cache(backend.prefill(context)[0])
    assert state.dtype == backend.dtype
    batched = generate_batch(backend, [Row(p, len(context)) for p in rows], state, Sampling(NEW))
    for prompt, in_batch in zip(rows, batched, strict=True):
        replay = backend.generate(prompt, None, Sampling(NEW)).token_ids
        resumed = backend.generate(prompt, state, Sampling(NEW)).token_ids
        assert_same_or_near_tie(backend, prompt, resumed, replay, "resume")
        assert_same_or_near_tie(backend, prompt, in_batch.token_ids, replay, "batched decode")
