"""Each workflow shape with the stateful compiler off and on: prefill tokens, wall time, identity.

Run: ``python examples/compiler_shapes.py [--model tiny-llama]``. Every shape is plain
``kvs.generate`` calls (see ``dask_kvstate/testing/shapes.py``); ``with kvs.stateflow()`` is the only change.

The script is ``python -m dask_kvstate.bench compiler-shapes [flags]`` (``--help`` lists the flags).
"""

from __future__ import annotations

import sys

from dask_kvstate import bench


def main(argv: list[str] | None = None):
    """``python -m dask_kvstate.bench compiler-shapes`` with this script's arguments (``--help`` lists them)."""
    return bench.main(["compiler-shapes", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
