"""Reply buffers a holder reuses to pack the blocks of one pull into one frame."""

from __future__ import annotations

import sys
import threading


class PackingBuffers:
    """Reply buffers a worker reuses to pack the blocks of one pull into one frame.

    Why one frame: Dask's TCP comm reads every separate buffer of a message with its own
    allocation and ``await``, and a pull of 21 blocks of 3 MiB took 66 ms against 43 ms
    for the same 64 MiB as one frame (loopback, 2 busy cores). Why reused buffers: a
    fresh 64 MiB allocation page-faults on the copy (50 ms against 43 ms), while a copy
    into warm memory is nearly free. A buffer is handed out again only once nothing
    references it (the comm has sent it); at most ``keep_bytes`` stay allocated.
    """

    def __init__(self, keep_bytes: int):
        self.keep_bytes = int(keep_bytes)
        self._buffers: list = []
        self._lock = threading.Lock()

    def take(self, nbytes: int):
        """A writable uint8 array of ``nbytes``: a view of an idle kept buffer, or new."""
        import numpy as np

        with self._lock:
            for buf in self._buffers:
                # references: the list, the loop variable, getrefcount's argument; a view
                # still queued on a comm holds one more through its ``.base``
                if buf.nbytes >= nbytes and sys.getrefcount(buf) <= 3:
                    return buf[:nbytes]
            buf = np.empty(nbytes, dtype=np.uint8)
            if sum(b.nbytes for b in self._buffers) + nbytes <= self.keep_bytes:
                self._buffers.append(buf)
            return buf[:nbytes] if buf.nbytes > nbytes else buf

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._buffers)
