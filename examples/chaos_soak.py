"""The chaos soak from the command line: workflows on worker processes that are killed
while the disk tier fills; prints the figures and writes them as JSON.

Tree of thought, debate, RAG and the SWE loop on tiny-llama, a ``SIGKILL`` to a random
worker every few workflows, the disk under the tiers filled to its last byte a third of
the way through. Every output must equal text replay and the cluster must hold nothing
at the end. The soak itself is :mod:`dask_kvstate.testing.chaos`; ``tests/test_chaos_soak.py``
runs it with the defaults.

Run::

    python examples/chaos_soak.py                              # 200 workflows, results/chaos/soak.json
    python examples/chaos_soak.py --workflows 40 --kill-per 4
    python examples/chaos_soak.py --backend vllm --workers 2 --workflows 40 --live 6 --kill-per 15 \
        --deadline 1200 --out results/chaos/soak-vllm.json   # SmolLM2 on vLLM engines, a failed step too
"""

from __future__ import annotations

import argparse
import asyncio
import json

from dask_kvstate.testing.chaos import ENGINES, SoakOptions, soak, summary


def main(argv=None) -> dict:
    d = SoakOptions()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=d.backend, choices=sorted(ENGINES), help="what computes (hf: tiny-llama)")
    p.add_argument("--workflows", type=int, default=d.workflows)
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--live", type=int, default=d.live, help="workflows in flight at once")
    p.add_argument("--kill-per", type=int, default=d.kill_per, help="a kill every this many finished workflows")
    p.add_argument("--min-alive", type=int, default=d.min_alive, help="workers the killer always leaves running")
    p.add_argument("--deadline", type=float, default=d.deadline, help="seconds for every workflow to finish")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default="results/chaos/soak.json")
    args = p.parse_args(argv)
    report = asyncio.run(soak(SoakOptions(**vars(args))))
    print(summary(report))
    print(json.dumps({k: report[k] for k in ("outcomes", "by_kind", "lifecycle", "final")}, indent=1))
    return report


if __name__ == "__main__":
    main()
