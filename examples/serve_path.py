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
"""

from __future__ import annotations

import argparse

from dask_kvstate.bench import serve_path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--wire", action="store_true", help="also time the two reply shapes between two processes")
    ap.add_argument("--torch-threads", type=int, default=1, help="as the workers run (kvs.install(torch_threads=1))")
    args = ap.parse_args(argv)
    return serve_path.run(args.mib, args.repeats, with_wire=args.wire, torch_threads=args.torch_threads)


if __name__ == "__main__":
    main()
