"""glibc's allocator told to keep the memory XLA:CPU frees, so a training step does not fault it in again.

XLA:CPU allocates each program execution's temporaries as ONE buffer with malloc (a coe step of the
reference config: 3-7 GB) and frees it when the step ends. glibc serves any request above its mmap
threshold (at most 32 MB) with a fresh anonymous mmap and unmaps it on free, so every step the kernel
zeroes and maps every 4 KB page of that buffer again: ~1M minor faults a step, 30 % of the process's CPU
time spent in the kernel (docs/benchmarks.md "The allocator: XLA:CPU's step buffer kept, on huge pages").

`keep_freed_memory()` sets three of glibc's `mallopt` parameters before XLA's threads first allocate:
every thread shares the main arena (M_ARENA_MAX 1: the per-thread arenas are 64 MB heaps, too small for
the step's buffer, which would go back to mmap), no request is served by mmap (M_MMAP_MAX 0: the main
arena grows with brk instead), and freed memory is never trimmed back to the kernel (M_TRIM_THRESHOLD -1).
The next step's buffer then reuses the pages of the last one. The cost: the process keeps its peak heap
until it exits, which a training, evaluation or serving process reaches again at its next step anyway.

Why mallopt and not jemalloc/tcmalloc (which also retain large blocks): neither ships on PyPI, and both
need LD_PRELOAD before the interpreter starts; mallopt is glibc's own and takes effect in-process, so
`empatheia` (cli.main) and the benchmarks call it first thing. Set `EMPATHEIA_KEEP_FREED_MEMORY=0` to leave
glibc's defaults. Off glibc (macOS, musl) it does nothing. The launch scripts add huge pages for that heap
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, launch/find_python.sh), which glibc reads only at start-up.
"""

from __future__ import annotations

import ctypes
import os
import sys

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

_SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))


def keep_freed_memory() -> bool:
    """Applies the settings above to this process; True when glibc took all of them. Call it before jax's
    backend starts (its threads pick their arena at their first allocation)."""
    if os.environ.get("EMPATHEIA_KEEP_FREED_MEMORY", "1").strip().lower() in ("0", "false", "no"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in _SETTINGS)
