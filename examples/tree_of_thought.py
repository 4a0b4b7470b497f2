"""Tree of thought on Dask: k branches explore one shared context, text replay vs kvstate.

Every branch reads the same incident report (~1,500 tokens) and answers its own
question. Text replay prefills the whole report once per branch; kvstate prefills it
once, forks the state, and each branch resumes from it (pulling the blocks when it
runs on another worker); "compiler" runs the text-replay code under
``kvs.stateflow()``, which inserts the state tasks by itself. The table compares
per-branch time to first token, total wall time, KV bytes and whether outputs are
token-identical. The workload and the table are :mod:`dask_kvstate.bench.tree_of_thought`.

Run: ``make demo [MODEL=gemma3-270m]`` or ``python examples/tree_of_thought.py [--model tiny-llama]``;
``--model`` also takes a local model folder or a local ``.gguf`` file.

The script is ``python -m dask_kvstate.bench tree-of-thought [flags]`` (``--help`` lists the flags).
"""

from __future__ import annotations

import sys

from dask_kvstate import bench


def main(argv: list[str] | None = None):
    """``python -m dask_kvstate.bench tree-of-thought`` with this script's arguments (``--help`` lists them)."""
    return bench.main(["tree-of-thought", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
