"""glibc keeps freed memory for reuse in a worker, as configured (``kvstate.worker.malloc-retain``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dask_kvstate import config
from dask_kvstate.plugins.worker.allocator import retain_freed_memory

# In a fresh process started the way Dask's nanny starts workers: is a 1 MiB malloc an
# mmap (mallinfo2's hblks counts mmapped chunks) before and after retain_freed_memory?
PROBE = textwrap.dedent(
    """
    import ctypes
    from dask_kvstate.plugins.worker.allocator import retain_freed_memory

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def mmapped_after_malloc():
        before = libc.mallinfo2().hblks
        p = libc.malloc(1 << 20)
        grew = libc.mallinfo2().hblks > before
        libc.free(p)
        return grew

    first = mmapped_after_malloc()
    ok = retain_freed_memory(256 << 20)
    print(first, ok, mmapped_after_malloc())
    """
)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc only"
)
def test_retain_makes_a_megabyte_come_from_the_heap_in_a_worker_like_process():
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536"}  # what Dask's nanny sets
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "False"]


def test_retain_rejects_a_non_positive_size():
    with pytest.raises(ValueError, match="positive"):
        retain_freed_memory(0)


@pytest.mark.parametrize("value", ["lots", "-1MiB"])
def test_config_check_names_a_bad_retain_size(value):
    with pytest.raises(ValueError, match="malloc-retain"):
        config.check({"worker": {"malloc-retain": value}})
    config.check({"worker": {"malloc-retain": None}})  # null: leave the C library alone
