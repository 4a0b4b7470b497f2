"""Another engine's claim on a core-sharing board (:func:`dask_kvstate.backends.core_share`),
from a process of its own, for tests: the board's rules are about other processes.

::

    python -m dask_kvstate.testing.core_peer CORES DIRECTORY stepping|stuck|idle

``stepping`` posts a step every 5 ms (the emulated work of an engine), ``stuck`` one
step begun alone that never ends, ``idle`` a claim with no work. It prints ``ready``
once on the board and holds its row until killed.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from dask_kvstate.backends import core_share

MODES = ("stepping", "stuck", "idle")


def start(cores: str, directory: str | Path, mode: str) -> subprocess.Popen:
    """A peer process on the board of ``cores`` in ``directory``, once it is on it."""
    if mode not in MODES:
        raise ValueError(f"core peer mode {mode!r} is not one of {MODES}")
    proc = subprocess.Popen(
        [sys.executable, "-m", __name__, cores, str(directory), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    if proc.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
        proc.kill()
        raise RuntimeError(f"core peer {mode} on {cores} did not start (exit code {proc.wait(timeout=30)})")
    return proc


def stop(proc: subprocess.Popen) -> None:
    """Kill a peer (no cleanup, as a crash) and reap it."""
    proc.kill()
    proc.wait(timeout=30)


def _steps(board) -> None:
    while True:
        board.threads()
        time.sleep(0.005)  # the step itself


def main(argv: list[str]) -> None:
    cores, directory, mode = argv
    board = core_share(cores, directory)
    if mode in ("stepping", "stuck"):
        board.threads()
    if mode == "stepping":
        threading.Thread(target=_steps, args=(board,), daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()  # hold the row until killed


if __name__ == "__main__":
    main(sys.argv[1:])
