"""The chaos soak (slow: minutes): 120 workflows on 3 worker processes while workers are
killed (one due every 6 finished workflows) and the disk tier fills. Every output token-identical to text replay, no
workflow lost or hung, and nothing held anywhere at the end.

The driver, the workflow mix and the final audit live in :mod:`dask_kvstate.testing`
(``examples/chaos_soak.py`` runs the same soak from the command line). The figures go to
the test's own temporary folder (``examples/chaos_soak.py`` writes ``results/chaos/soak.json``).
"""

from __future__ import annotations

import asyncio

import pytest

from dask_kvstate.testing.chaos import SoakOptions, soak, summary

pytestmark = pytest.mark.slow

#: The SWE workflows' emulated test runs (the soak's default 0.3 s): long enough that the
#: chaos outlasts the killer's pacing (a victim up 3 s, kills 1 s apart) for five kills even
#: where the model computes fast; at 0.3 s a faster machine ran the 120 workflows in 9.3 s
#: and the killer made 4.
TOOL_SECONDS = 1.0


@pytest.mark.timeout(600)
def test_chaos_soak_every_output_identical_and_nothing_left(tmp_path):
    opts = SoakOptions(workflows=120, kill_per=6, tool_seconds=TOOL_SECONDS, out=str(tmp_path / "soak.json"))
    report = asyncio.run(soak(opts))
    print(summary(report))
    assert report["outcomes"] == {"identical": opts.workflows}, report["problems"]  # none different, failed or hung
    assert report["run_seconds"] < opts.deadline
    assert report["kills"] >= 5  # it really was chaos: SIGKILLed workers, their work redone
    assert report["recomputes"] > 0 and report["retries"] + report["lost_results"] > 0
    if report["tmpfs"]:
        assert report["disk_full"] > 0 and any(e["event"] == "filled" for e in report["disk"])  # a real ENOSPC
    final = report["final"]
    assert (final["bytes"], final["pins"], final["holds"], final["blocks"]) == (0, 0, 0, 0), final
    assert final["leaks"] == {}, final["leaks"]  # nor a ref key, session record or spill file; no stale report
    assert report["sessions_ended"] >= opts.workflows
