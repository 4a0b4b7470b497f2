"""The hf-kernels bench times the three ways to run the linear layers on one model and
refuses to report runs whose tokens differ (timings are printed, never asserted)."""

from __future__ import annotations

import json

from dask_kvstate.bench import hf_kernels, registry


def test_hf_kernels_times_every_mode_with_equal_tokens(tmp_path, capsys):
    opts = hf_kernels.Options(
        model="tiny-llama", lengths=[160, 96], agents=3, new_tokens=4, repeats=1, out=str(tmp_path)
    )
    res = hf_kernels.command(opts)
    assert set(res["medians_s"]) == set(hf_kernels.MODES) and res["outputs_equal"]
    for mode in hf_kernels.MODES:
        prefills = [k for k in res["medians_s"][mode] if k.startswith("prefill ")]
        assert len(prefills) == 2 and "prefill 96" in prefills
        assert {"3 agents x 4", "of it: decode", "one resume"} < set(res["medians_s"][mode])
        assert all(v > 0 for v in res["medians_s"][mode].values())
    assert res["fused_mlps"] == 2  # tiny-llama's two layers, left fused as the backend runs them
    assert "| plain / fused |" in capsys.readouterr().out
    assert json.loads((tmp_path / "hf_kernels.json").read_text())["options"]["agents"] == 3
    assert "hf-kernels" in registry.EXPERIMENTS
