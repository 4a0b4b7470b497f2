"""oneDNN-packed linear layers in the transformers backend: the same tokens as plain
transformers, the weights untouched, and a clear account of when nothing is packed."""

from __future__ import annotations

import copy

import dask
import pytest
import torch
import torch.nn.functional as F

from dask_kvstate.backends import models, packed_linear
from dask_kvstate.backends.hf import HFBackend
from dask_kvstate.generation import Sampling

from .conftest import stats_of

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@pytest.fixture(scope="module")
def plain():
    """tiny-llama as transformers loads it (nothing packed): the reference."""
    model, tokenizer = models.load("tiny-llama")
    return model, tokenizer


def _linears(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_pack_swaps_every_plain_linear_and_leaves_the_weights_and_state_dict_alone(plain):
    model = copy.deepcopy(plain[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n, why = packed_linear.pack(model)
    assert why is None and n == len(_linears(model)) > 0
    assert all(type(m) is packed_linear.PackedLinear for m in _linears(model))
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert packed_linear.pack(model) == (0, "its linear layers are packed already")
    assert packed_linear.unpack(model) == n
    assert all(type(m) is torch.nn.Linear and not hasattr(m, "_kvstate_packed") for m in _linears(model))


def test_a_packed_layer_computes_the_linear_and_falls_back_where_it_cannot_run():
    layer = torch.nn.Linear(96, 160, bias=True)
    x = torch.randn(3, 7, 96)
    with torch.no_grad():
        want = F.linear(x, layer.weight, layer.bias)
    model = torch.nn.Sequential(layer)
    assert packed_linear.pack(model) == (1, None)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # With gradients on, the stock forward (oneDNN's op has no backward): the same numbers as F.linear, bit for bit.
    y = layer(x)
    assert y.requires_grad and torch.equal(y.detach(), F.linear(x, layer.weight, layer.bias).detach())
    with torch.no_grad(), pytest.raises(RuntimeError):
        layer(x.double())  # another dtype than the weight's: refused as nn.Linear refuses it, not a wrong result


def test_packed_backend_generates_what_plain_transformers_generates(plain):
    model, tokenizer = plain
    packed = HFBackend("tiny-llama", copy.deepcopy(model), tokenizer)
    assert packed.packed_linear == len(_linears(model)) and packed.engine_stats()["packed_linear"] > 0
    assert packed.fused_mlps == model.config.num_hidden_layers == packed.engine_stats()["fused_mlps"]
    prompts = ["The quick brown fox", "Once upon a time, in a land far away, there lived", "def add(a, b):"]
    for text in prompts:
        ids = packed.tokenize(text)
        got = packed.generate(ids, None, Sampling(max_new_tokens=12)).token_ids
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        assert got == out[0, len(ids) :].tolist()[: len(got)], text
        # and a resume from its own prefill's KV agrees with its replay
        cache, _ = packed.prefill(ids[:-3])
        resumed = packed.generate(ids, packed.kv_from_cache(cache), Sampling(max_new_tokens=12)).token_ids
        assert resumed == got, text
    # The packed copy is not part of the model's identity: KV of either kind is the same model's.
    plain_backend = HFBackend("tiny-llama", copy.deepcopy(model), tokenizer)
    assert packed.model_fingerprint == plain_backend.model_fingerprint


def test_switched_off_nothing_is_packed_and_stats_say_why(plain):
    model, tokenizer = plain
    with dask.config.set({"kvstate.hf.packed-linear": False}):
        backend = HFBackend("tiny-llama", copy.deepcopy(model), tokenizer)
    assert backend.packed_linear == 0 and backend.fused_mlps == 0
    assert not any(type(m) is packed_linear.PackedLinear for m in backend.model.modules())
    assert "packed-linear" in backend.engine_stats()["packed_linear_skipped"]


def test_a_dtype_onednn_cannot_pack_is_reported_not_raised():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64).half(), torch.nn.Linear(64, 64).half())
    n, why = packed_linear.pack(model)
    if n:  # a CPU with AVX512-FP16 packs float16 too
        assert n == 2 and why is None
    else:
        assert "float16" in why and all(type(m) is torch.nn.Linear for m in model)
    assert packed_linear.pack(torch.nn.Sequential(torch.nn.ReLU())) == (0, "no nn.Linear layer on the CPU")


class _GatedMLP(torch.nn.Module):
    """A Llama-style gated MLP; ``swap`` multiplies the other way round (gate and up exchanged)."""

    def __init__(self, act: torch.nn.Module, swap: bool = False) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(48, 80, bias=False), torch.nn.Linear(48, 80, bias=False)
        self.down_proj, self.act_fn, self.swap = torch.nn.Linear(80, 48, bias=False), act, swap

    def forward(self, x):
        a, b = (self.up_proj, self.gate_proj) if self.swap else (self.gate_proj, self.up_proj)
        return self.down_proj(self.act_fn(a(x)) * b(x))


@pytest.mark.parametrize(
    "act, epilogue",
    [
        (torch.nn.SiLU(), ("swish", "")),
        (torch.nn.GELU(approximate="tanh"), ("gelu", "tanh")),
        (torch.nn.GELU(), ("gelu", "none")),
    ],
)
def test_gated_mlps_are_fused_only_where_the_fused_form_computes_the_same(act, epilogue):
    mlp, other = _GatedMLP(act), _GatedMLP(act, swap=True)
    model = torch.nn.Sequential(mlp, other)
    x = torch.randn(2, 5, 48)
    with torch.no_grad():
        want, want_other = mlp(x), other(x)
    packed_linear.pack(model)
    assert packed_linear.fuse_gated_mlps(model) == 1
    assert mlp._kvstate_fused == epilogue and "forward" in vars(mlp)
    assert not hasattr(other, "_kvstate_fused") and "forward" not in vars(other)  # same names, another function
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(other(x), want_other, rtol=1e-5, atol=1e-5)
    assert packed_linear.fuse_gated_mlps(model) == 0  # fused already
    packed_linear.unpack(model)
    assert "forward" not in vars(mlp) and not hasattr(mlp, "_kvstate_fused")
    with torch.no_grad():
        assert torch.equal(mlp(x), want)  # the stock path again, bit for bit


def test_an_activation_onednn_cannot_fuse_keeps_the_modules_own_forward():
    mlp = _GatedMLP(torch.nn.ReLU())
    packed_linear.pack(mlp)
    assert packed_linear.fuse_gated_mlps(mlp) == 0 and "forward" not in vars(mlp)


def test_every_worker_reports_its_packed_layers(client, workers):
    for w in workers:
        engine = stats_of(client, w)["engine"]
        assert engine["engine"] == "transformers" and engine["packed_linear"] > 0 and engine["fused_mlps"] > 0, engine


def test_a_weight_changed_after_packing_is_packed_again_or_runs_stock():
    layer = torch.nn.Linear(32, 48)
    model = torch.nn.Sequential(layer)
    packed_linear.pack(model)
    x = torch.randn(4, 32)
    with torch.no_grad():
        layer.weight.mul_(3.0)  # in place (a fine-tune step, load_state_dict)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(48, 32))  # replaced
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        model.double()  # cast to a dtype oneDNN does not pack: the stock layer, exactly
        assert torch.equal(layer(x.double()), F.linear(x.double(), layer.weight, layer.bias))
