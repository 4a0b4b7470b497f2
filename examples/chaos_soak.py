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

The script is ``python -m dask_kvstate.bench chaos-soak [flags]`` (``--help`` lists the flags).
"""

from __future__ import annotations

import sys

from dask_kvstate import bench


def main(argv: list[str] | None = None):
    """``python -m dask_kvstate.bench chaos-soak`` with this script's arguments (``--help`` lists them)."""
    return bench.main(["chaos-soak", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
