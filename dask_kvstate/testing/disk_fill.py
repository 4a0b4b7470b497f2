"""A disk that really fills: a small filesystem of its own under the disk tiers, and a ballast.

The chaos soak puts every worker's local directory (so its disk tier) on a tmpfs of a
few MiB, so spills past it fail with a real ``ENOSPC``, not a budget the store checks
itself; :class:`DiskFiller` takes the last free byte mid-run and gives it back later.
Mounting needs root; without it :func:`small_disk` yields a plain folder and says so,
and the ballast is never written (it would fill a real disk).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator


@contextlib.contextmanager
def small_disk(nbytes: int) -> Iterator[tuple[str, bool]]:
    """A folder on a tmpfs of ``nbytes``: ``(path, True)``; ``(a plain folder, False)`` when mounting fails."""
    path = tempfile.mkdtemp(prefix="kvstate-soak-disk-")
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", path], capture_output=True)
    except OSError:  # no mount command here
        mounted = False
    else:
        mounted = done.returncode == 0
    try:
        yield path, mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", path], check=False)
        with contextlib.suppress(OSError):
            os.rmdir(path)


class DiskFiller:
    """Fills a filesystem to its last byte with a ballast file, and frees it."""

    def __init__(self, path: str, enabled: bool = True):
        self.path = os.path.join(path, "ballast")
        self.enabled = enabled  # never on a real disk: only on the soak's own small filesystem
        self.filled = 0  # bytes the ballast took
        self.events: list[dict] = []

    def fill(self) -> None:
        """Write the ballast until the filesystem says ``ENOSPC``."""
        if not self.enabled:
            return
        chunk = b"\0" * (64 << 10)
        st = os.statvfs(os.path.dirname(self.path))
        self.events.append({"t": time.time(), "event": "filling", "free_bytes": st.f_bavail * st.f_frsize})
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as e:  # already full: not even the file's entry fits
            if e.errno != errno.ENOSPC:
                raise
            self.events.append({"t": time.time(), "event": "full already"})
            return
        try:
            while chunk:
                try:
                    self.filled += os.write(fd, chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    chunk = chunk[: len(chunk) // 2]  # the last free bytes, in ever smaller writes
        finally:
            os.close(fd)
        self.events.append({"t": time.time(), "event": "filled", "bytes": self.filled})

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)
            self.events.append({"t": time.time(), "event": "freed"})
