"""The cores a vLLM engine steps on, shared with the other engines of its host given the same ones.

A vLLM engine on the CPU runs each step on one OpenMP thread per core it was given. Two
Dask workers on one host whose engines are both given all of its cores then run twice as
many threads as cores whenever both step at once, and teams oversubscribed that way wait
on each other at every barrier. Giving each engine a core of its own avoids that but
leaves a core idle while the other engine prefills alone, and a prefill is the longest
step there is (the figures are in the benchmark pages).

So engines given the same cores post on a board in shared memory whether they are
stepping, and before each step an engine takes its share of the cores: all of them while
it steps alone, an even split while others step too. vLLM's CPU attention plans each step
for the thread count it runs with, so the count may change between steps; the outputs
stay token-identical across counts (``tests/test_vllm.py``).

No library does this: OpenMP's own dynamic adjustment (``OMP_DYNAMIC``) sees the threads
of its own process only, and vLLM sizes an engine once, at start.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import tempfile
import time
from pathlib import Path

import numpy as np

SLOTS = 64  # engines one board can hold; more on one core set would be far past its cores
# A row: the engine's process (pid, and its start time, so a reused pid is not taken for
# it), whether it has work, and the threads its current step runs on.
_PID, _BORN, _WANT, _USING = 0, 1, 2, 3
_COLUMNS = 4
# How long an engine waits for another's step, begun while it stepped alone, to end before
# starting its own on too many threads: a step is usually shorter, but a long prefill
# should not hold a short request back for seconds.
MAX_WAIT_S = 0.5


def cores_of_this_process() -> str:
    """Every core this process may run on, as vLLM's binding spec ("0,1")."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return ",".join(str(c) for c in cores)


def parse_cores(spec: str) -> list[int]:
    """The cores a binding spec names, in order.

    >>> parse_cores("0-3"), parse_cores("0,2"), parse_cores("1")
    ([0, 1, 2, 3], [0, 2], [1])
    """
    cores: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            cores += range(int(lo), int(hi) + 1) if hi else [int(lo)]
        except ValueError:
            raise ValueError(f"kvstate.vllm.cpu-cores {spec!r} is not a core list like '0-3' or '0,2'") from None
    if not cores:
        raise ValueError(f"kvstate.vllm.cpu-cores {spec!r} names no core")
    return cores


def count_cores(spec: str) -> int:
    """How many cores a binding spec names.

    >>> count_cores("0-3"), count_cores("0,2"), count_cores("1")
    (4, 2, 1)
    """
    return len(parse_cores(spec))


def share(cores: int, busy: int, rank: int) -> int:
    """Threads for the engine ranked ``rank`` of ``busy`` engines stepping on ``cores`` cores.

    An even split, the leftover cores to the first ranks; never less than one thread.

    >>> [share(4, 3, r) for r in range(3)], share(2, 1, 0), share(2, 3, 2)
    ([2, 1, 1], 2, 1)
    """
    whole, left = divmod(cores, max(1, busy))
    return max(1, whole + (1 if rank < left else 0))


def _born(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot), -1 if it is gone; 0 where
    ``/proc`` cannot say (then a live pid is taken as the same process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return -1
    except OSError:
        return 0
    # Field 22, counted after the command name, which is in parentheses and may hold spaces.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def _alive(pid: int, born: int) -> bool:
    """Whether the process of a row still runs: pid ``pid``, started at ``born``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # boards are per user: another user's process is a reused pid
        return False
    now = _born(pid)
    return now != -1 and (now == born or 0 in (now, born))


def _board_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class CoreShare:
    """This engine's slot on the board of the engines given ``cores`` on this host.

    The board is a file of ``SLOTS`` rows ``(pid, process start, has work, threads in
    use)`` mapped by every such engine; a row whose process died is free again (a pid
    reused by another process does not keep it), so a killed worker leaves no lasting claim.
    """

    def __init__(self, cores: str, directory: str | Path | None = None):
        self.spec = cores
        self.cores = count_cores(cores)
        key = hashlib.sha1(",".join(map(str, sorted(set(parse_cores(cores))))).encode()).hexdigest()[:16]
        # Per user: another user's engines are not ours to yield to, nor theirs to read.
        self.path = Path(directory or _board_dir()) / f"dask-kvstate-cores-v2-{os.getuid()}-{key}"
        size = SLOTS * _COLUMNS * 8
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
                self._rows = np.ndarray((SLOTS, _COLUMNS), dtype=np.int64, buffer=self._map)
                self.slot = self._claim()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self._busy = False
        self._closed = False

    def _claim(self) -> int:
        pid = os.getpid()
        for slot in range(SLOTS):
            owner = int(self._rows[slot, _PID])
            if owner == 0 or not _alive(owner, int(self._rows[slot, _BORN])):
                self._rows[slot] = (pid, _born(pid), 0, 0)
                return slot
        raise RuntimeError(f"{SLOTS} engines already share cores on {self.path}: no slot left")

    def threads(self) -> int:
        """Mark this engine as having work, and the threads its next step should run on.

        Its share counts every engine with work; if those stepping now already use more
        cores than the share leaves (a step one of them began alone), it waits for their
        steps to end, up to ``MAX_WAIT_S``, rather than oversubscribe the cores.
        """
        rows = self._rows
        rows[self.slot, _USING] = 0  # between steps: running on nothing
        rows[self.slot, _WANT] = 1
        self._busy = True
        deadline = time.monotonic() + MAX_WAIT_S
        while True:
            now = rows.copy()
            others = [s for s in np.flatnonzero(now[:, _PID]).tolist() if s != self.slot and self._live(now, s)]
            wanting = sorted([self.slot, *(s for s in others if now[s, _WANT])])
            threads = share(self.cores, len(wanting), wanting.index(self.slot))
            in_use = sum(int(now[s, _USING]) for s in others)
            # More engines with work than cores: one thread each is all the split can do.
            if in_use + threads <= max(self.cores, len(wanting)) or time.monotonic() > deadline:
                rows[self.slot, _USING] = threads
                return threads
            time.sleep(0.001)

    def _live(self, rows: np.ndarray, slot: int) -> bool:
        """Whether a claimed row belongs to a running engine (of another process, or an
        earlier engine of this one whose driver has not stopped yet). A syscall and a
        ``/proc`` read, about 10 us here: cheap beside a step."""
        return _alive(int(rows[slot, _PID]), int(rows[slot, _BORN]))

    def idle(self) -> None:
        """Mark this engine idle: its cores go to the others' next steps."""
        if self._busy:
            self._rows[self.slot, _WANT] = 0
            self._rows[self.slot, _USING] = 0
            self._busy = False

    def close(self) -> None:
        """Give the slot back."""
        if self._closed:
            return
        self._closed = True
        self._rows[self.slot] = (0, 0, 0, 0)
        del self._rows  # the map cannot close while a view of it lives
        self._map.close()
