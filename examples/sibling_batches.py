"""Where the 16-agent run's time goes on the bench's cluster, per sibling batch, for several batch sizes.

Runs the bench's kvstate workload (k agents over one shared context, Y new tokens)
on 2 workers x 1 thread, once per ``--batch`` value, alternating, in one cluster, and
prints per run: the wall time, each batch's time to first token (its state resolve,
pull included, plus its suffix prefill), its suffix prefill and its decode, and the
CPU seconds each worker process used. ``--batch 8,16,8,16`` compares two batches of 8
(one per worker) with one batch of 16 on the holder.

Run: ``python examples/sibling_batches.py [--model smollm2-135m] [--tokens 4096] [--agents 16] [--batch 8,16]``.

The script is ``python -m dask_kvstate.bench sibling-batches [flags]`` (``--help`` lists the flags).
"""

from __future__ import annotations

import sys

from dask_kvstate import bench


def main(argv: list[str] | None = None):
    """``python -m dask_kvstate.bench sibling-batches`` with this script's arguments (``--help`` lists them)."""
    return bench.main(["sibling-batches", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
