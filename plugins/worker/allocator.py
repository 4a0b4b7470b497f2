"""Let glibc keep freed memory for reuse inside a worker running a model.

Why: Dask's nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536`` so that freed
memory goes back to the OS and the worker's RSS tracks its live data (distributed's
"memory not released back to the OS" notes). Setting that variable also freezes glibc's
mmap threshold at its 128 KiB default, so every tensor over 128 KiB that a forward pass
allocates (activations, MLP intermediates, logits) is a fresh ``mmap`` whose pages fault
in again, and is unmapped on free. Measured on SmolLM2, a 4,074-token prefill on two
threads: 10.1 s in a plain process, 12.4 s with that variable, 9.5 s with it and the two
thresholds below raised again at run time (``mallopt``). torch's CPU allocator has no
cache of its own (it calls ``posix_memalign``), so glibc's settings are the lever.

The cost is memory the worker keeps: up to ``retain`` bytes of freed heap stay mapped,
which Dask's memory monitor then sees as unmanaged memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger("dask_kvstate")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX).
_MMAP_THRESHOLD_MAX = 32 * 2**20


def retain_freed_memory(retain: int) -> bool:
    """Raise glibc's trim threshold to ``retain`` bytes and its mmap threshold to match.

    Returns False, changing nothing, where the C library is not glibc (musl, macOS,
    Windows) or refuses a value. Process-wide; call it in the worker process.
    """
    if retain <= 0:
        raise ValueError(f"retain must be a positive number of bytes, got {retain}")
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl has mallopt as a no-op
            return False
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, min(retain, _MMAP_THRESHOLD_MAX)) == 1
    ok = ok and mallopt(_M_TRIM_THRESHOLD, retain) == 1
    if not ok:
        logger.warning("kvstate: glibc refused malloc thresholds for retain=%d bytes", retain)
    return ok
