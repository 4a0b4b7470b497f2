"""Where a resume's time goes at long context, in process: prefill vs block join vs cache copy vs forward.

Two resume paths are timed to their first token: transformers' own cache (the prefix
copied into a ``DynamicCache``) and the shared-prefix path kvstate uses (the prefix
read in place, ``backends/cascade.py``).

Run: ``python examples/profile_resume.py [--model smollm2-135m] [--tokens 4096]``.

The script is ``python -m dask_kvstate.bench profile-resume [flags]`` (``--help`` lists the flags).
"""

from __future__ import annotations

import sys

from dask_kvstate import bench


def main(argv: list[str] | None = None):
    """``python -m dask_kvstate.bench profile-resume`` with this script's arguments (``--help`` lists them)."""
    return bench.main(["profile-resume", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
