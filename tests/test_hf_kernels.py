"""The hf-kernels bench times the three ways to run the linear layers on one model and
refuses to report runs whose tokens differ (timings are printed, never asserted)."""

from __future__ import annotations

import json

import pytest

from dask_kvstate.bench import hf_kernels, registry

vllm_test_marks = pytest.mark.needs_vllm  # vLLM's CPU attention kernel: skipped, saying why, without vLLM


def test_hf_kernels_times_every_mode_with_equal_tokens(tmp_path, capsys):
    opts = hf_kernels.Options(
        model="tiny-llama", lengths=[160, 96], agents=3, new_tokens=4, repeats=1, out=str(tmp_path)
    )
    res = hf_kernels.command(opts)
    # tiny-llama's 16-dim heads are narrower than vLLM's CPU kernel serves: that mode is left out, saying why.
    modes = [m for m in hf_kernels.MODES if m != hf_kernels.VLLM_ATTENTION]
    assert list(res["medians_s"]) == modes and res["outputs_equal"]
    for mode in modes:
        prefills = [k for k in res["medians_s"][mode] if k.startswith("prefill ")]
        assert len(prefills) == 2 and "prefill 96" in prefills
        assert {"3 agents x 4", "of it: decode", "one resume"} < set(res["medians_s"][mode])
        assert all(v > 0 for v in res["medians_s"][mode].values())
    assert res["fused_mlps"] == 2  # tiny-llama's two layers, left fused as the backend runs them
    out = capsys.readouterr().out
    assert "| plain / fused |" in out and "head size 16 is not one vLLM's CPU kernel supports" in out
    assert json.loads((tmp_path / "hf_kernels.json").read_text())["options"]["agents"] == 3
    assert "hf-kernels" in registry.EXPERIMENTS


@vllm_test_marks
def test_hf_kernels_adds_vllm_attention_where_the_kernel_loads(tmp_path_factory, capsys):
    """A model with 32-dim heads: the fourth mode runs, and its tokens equal plain transformers'."""
    from dask_kvstate.testing import architectures

    folder = architectures.build("llama", tmp_path_factory.getbasetemp() / "kit", wide=True)
    opts = hf_kernels.Options(model=str(folder), lengths=[200, 96], agents=3, new_tokens=4, repeats=1)
    res = hf_kernels.command(opts)
    assert list(res["medians_s"]) == list(hf_kernels.MODES) and res["outputs_equal"]
    assert f"| plain / {hf_kernels.VLLM_ATTENTION} |" in capsys.readouterr().out
