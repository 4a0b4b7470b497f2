"""Causal LM classes judged by what they are (dask_kvstate.testing.families), in this process.

The whole enumeration takes minutes (``python -m dask_kvstate.testing.families``); these
are the classes whose outcome says the most: the ones that crashed or gave other tokens
before the backend measured its KV and checked its cascade, and one of each refusal.
Each path compares with transformers' own ``model.generate`` token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dask_kvstate.testing import families

IDENTICAL = ["stablelm", "deepseek_v3", "falcon", "gpt2", "smollm3", "llama4_text", "cohere2_moe", "apertus"]
REFUSED = {
    "qwen3_next": "linear_attention",  # a recurrent state beside the KV
    "lfm2": "conv",  # short-convolution layers
    "gemma3": "vision_config",  # a vision tower
    "roberta": "positions independent of the token ids",
    "rwkv": "not a DynamicCache",  # no KV at all
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type", IDENTICAL)
def test_identical_on_every_path(model_type):
    outcome = families.judge(model_type, families.causal_lm_classes()[model_type])
    assert outcome.outcome == families.IDENTICAL, outcome


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_naming_what_it_lacks(model_type):
    outcome = families.judge(model_type, families.causal_lm_classes()[model_type])
    assert outcome.outcome == families.REFUSED, outcome
    assert f"model type {model_type!r} is not supported" in outcome.why and REFUSED[model_type] in outcome.why


def test_tiny_config_keeps_every_kind_of_layer():
    """Three layers of Llama 4 still hold a global layer among the chunked ones, SmolLM3 a NoPE layer."""
    llama4 = families.tiny_config("llama4_text")
    assert sorted(set(llama4.layer_types)) == ["chunked_attention", "full_attention"]
    assert 0 in families.tiny_config("smollm3").no_rope_layers


def test_the_committed_table_has_no_crash_and_no_different_token():
    page = (Path(__file__).parents[1] / "docs" / "guide" / "families.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) > 100  # every class of the mapping, not a list
    assert not [r for r in rows if f"| {families.DIFFERENT} |" in r or f"| {families.CRASH} |" in r]
