"""The holder's serve path and the wire, in isolation: packing copy vs block arena.

Three measurements, each a median of ``--repeats``, both sides interleaved:

* **serve**: the handler's work for a 64 MiB pull of SmolLM2-135M-shaped blocks (30
  layers, 3 KV heads, head dim 64, float32, 64-token blocks) in one process: packing
  them into a warm reply buffer (``serve_blocks`` with the zero-copy path off) against
  finding the arena run (``serve_run``).
* **receive**: the puller's work on a reply already read: ``unpack_blocks`` plus the
  store inserts.
* **wire** (``--wire``): a worker RPC between two processes replying with the arena's
  memory, its small layout either in the message or as a second frame (which one the
  zero-copy reply should use), beside Dask's ``get_data`` of a numpy array of the
  same bytes.

The measurements are :mod:`dask_kvstate.bench.serve_path`.

Run: ``python examples/serve_path.py [--repeats 25] [--wire]``.

The script is ``python -m dask_kvstate.bench serve-path [flags]`` (``--help`` lists the flags).
"""

from __future__ import annotations

import sys

from dask_kvstate import bench


def main(argv: list[str] | None = None):
    """``python -m dask_kvstate.bench serve-path`` with this script's arguments (``--help`` lists them)."""
    return bench.main(["serve-path", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
