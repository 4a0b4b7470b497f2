"""``python -m dask_kvstate.bench chaos-soak``: the chaos soak from the command line.

The soak itself (workflows on worker processes that are killed while the disk tier
fills, every output checked against text replay, nothing held at the end) is
:mod:`dask_kvstate.testing.chaos`, which ``tests/test_chaos_soak.py`` runs with its
defaults. Its settings are :class:`~dask_kvstate.testing.chaos.SoakOptions`; the command
line takes them as they are, with the report written to a file by default (a test
writes it to its own temporary folder).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import ClassVar

from dask_kvstate.testing.chaos import ENGINES, SoakOptions, soak, summary


@dataclass
class Options(SoakOptions):
    """:class:`~dask_kvstate.testing.chaos.SoakOptions`, each with its flag's help, the report to a file."""

    # The help of the fields SoakOptions declares (dask_kvstate.bench.options reads it).
    FIELD_METADATA: ClassVar[dict[str, dict]] = {
        "backend": {
            "help": "what computes (hf: tiny-llama; vllm: SmolLM2 on vLLM engines)",
            "choices": sorted(ENGINES),
        },
        "workflows": {"help": "workflows in all"},
        "workers": {"help": "worker processes, each under a nanny"},
        "live": {"help": "workflows in flight at once"},
        "kill_per": {"help": "a kill every this many finished workflows"},
        "min_alive": {"help": "workers the killer always leaves running"},
        "deadline": {"help": "seconds for every workflow to finish"},
        "settle": {"help": "seconds for the cluster to hold nothing afterwards"},
        "disk_blocks": {"help": "blocks the small filesystem under the disk tiers holds"},
        "device_blocks": {"help": "blocks a worker's device tier holds"},
        "host_blocks": {"help": "blocks a worker's host tier holds"},
        "tool_seconds": {"help": "median seconds of the SWE loop's test runs"},
        "full_wait": {"help": "the most seconds the disk stays full past its slot, until a spill meets ENOSPC"},
        "seed": {"help": "seed of the workflow mix and of the killer's picks"},
    }

    out: str | None = field(default="results/chaos/soak.json", metadata={"help": "a JSON file for the report"})


def command(opts: Options) -> dict:
    """Run the soak; print its summary and the figures a reader checks first."""
    report = asyncio.run(soak(opts))
    print(summary(report))
    print(json.dumps({k: report[k] for k in ("outcomes", "by_kind", "lifecycle", "final")}, indent=1))
    return report
