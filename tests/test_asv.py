"""The asv suite runs as the README says, on a fresh clone: config, discovery, skips, results.

One small suite (``block_store.TierOps``) is run by the real ``asv`` command under a copy
of ``asv_bench/asv.conf.json`` whose results, html and machine file live in a temporary
folder (``asv machine --yes --machine ci`` with ``HOME`` there), so nothing of the
user's is read or written. The result file must hold a number for every measured
combination and NaN (asv's skip) for the combinations ``setup`` rejects; a failed one
would be None.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = "block_store.TierOps.track_ratio"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("asv") is None, reason="asv is not installed (pip install -e '.[test]')"
)


def asv(*args: str, cwd: Path, home: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "asv", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_asv_quick_run_writes_a_number_per_measured_combination(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("asv records results against a commit: needs a git checkout")
    conf = json.loads((ROOT / "asv_bench" / "asv.conf.json").read_text())
    conf.update(
        repo=str(ROOT),
        benchmark_dir=str(ROOT / "asv_bench" / conf["benchmark_dir"]),
        env_dir=str(tmp_path / "env"),
        results_dir=str(tmp_path / "results"),
        html_dir=str(tmp_path / "html"),
    )
    (tmp_path / "asv.conf.json").write_text(json.dumps(conf))
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()

    machine = asv("machine", "--yes", "--machine", "ci", cwd=tmp_path, home=tmp_path, timeout=60)
    assert machine.returncode == 0, machine.stdout + machine.stderr
    run = asv(
        "run",
        "--python=same",
        "--quick",
        "--machine",
        "ci",
        "--set-commit-hash",
        commit,
        "--bench",
        BENCH,
        "--show-stderr",
        cwd=tmp_path,
        home=tmp_path,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr  # asv exits 2 when a benchmark failed

    (result_file,) = [p for p in (tmp_path / "results" / "ci").glob("*.json") if p.name != "machine.json"]
    saved = json.loads(result_file.read_text())
    assert saved["commit_hash"] == commit
    row = dict(zip(saved["result_columns"], saved["results"][BENCH]))
    ops, tiers, sizes = row["params"]
    assert (ops, tiers) == (["'put'", "'get'", "'spill'", "'unspill'"], ["'device'", "'host'", "'disk'"])
    values = iter(row["result"])
    measured = skipped = 0
    for op in ops:
        for tier in tiers:
            for _ in sizes:
                value = next(values)
                assert isinstance(value, float), (op, tier, value)  # a failure is recorded as None
                if (tier == "'device'") == (op in ("'put'", "'get'")):
                    assert math.isfinite(value) and value > 0, (op, tier, value)
                    measured += 1
                else:
                    assert math.isnan(value), (op, tier, value)  # skipped in setup: asv records NaN
                    skipped += 1
    assert measured == skipped == 12
