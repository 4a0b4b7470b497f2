"""The shared-prefix probe runs vLLM's own CPU attention kernel on both block layouts.

The kernel must give the same outputs whether the rows' prefix blocks are shared (as
vLLM's prefix cache gives siblings) or copied per row: the probe refuses to time
layouts that disagree. Timings are printed by the bench command, never asserted.
"""

from __future__ import annotations

import pytest

from dask_kvstate.bench import registry

from .conftest import vllm_test


@vllm_test
def test_the_probe_times_vllms_kernel_on_shared_and_copied_prefix_blocks(capsys):
    from dask_kvstate.bench import vllm_shared_prefix as probe

    res = probe.command(probe.Options(rows=3, prefix=128, suffix=5, queries=[1, 4], repeats=2))
    assert [r["queries"] for r in res["table"]] == [1, 4]
    for row in res["table"]:
        assert row["shared_ms"] > 0 and row["copies_ms"] > 0 and row["two_gemms_ms"] > 0
    assert "a copy per row" in capsys.readouterr().out
    assert "vllm-shared-prefix" in registry.EXPERIMENTS


def test_the_probe_names_a_prefix_that_is_not_whole_blocks():
    from dask_kvstate.bench import vllm_shared_prefix as probe

    with pytest.raises(ValueError, match="--prefix 100 must be a multiple of --block-tokens 64"):
        probe.command(probe.Options(prefix=100))
