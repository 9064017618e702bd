"""`host_memory.keep_freed_memory`: a freed large buffer is reused without faulting its pages in again.

Each case runs in a fresh interpreter (glibc's settings are per process, and the suite's own process must
keep its defaults): it mallocs a 256 MB buffer, writes every page, frees it, then does the same again on a
thread (as XLA's executor threads do) and counts the minor page faults of that second round.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import needs_platform

REPO = Path(__file__).resolve().parents[1]
PAGES = 65536  # 256 MB of 4 KB pages

KEEP = """
from empatheia_jax.host_memory import keep_freed_memory
applied = keep_freed_memory()
"""
# `empatheia --help` as the process's entry point (argv None) or called with its argv from a caller's process
CLI = """
import sys
from empatheia_jax import cli
sys.argv = ["empatheia", "--help"]
try:
    cli.main({argv})
except SystemExit:
    pass
applied = None
"""
PROBE = f"""
import ctypes, resource, sys, threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
SIZE = {PAGES} * 4096

def touch():
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    libc.free(p)

touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = threading.Thread(target=touch)
t.start()
t.join()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _second_round_faults(keep: str, prologue: str = KEEP) -> tuple[bool, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "EMPATHEIA_KEEP_FREED_MEMORY": keep}
    out = subprocess.run([sys.executable, "-c", prologue + PROBE], env=env, capture_output=True, text=True,
                         check=True)
    applied, faults = out.stdout.split()[-2:]
    return applied == "True", int(faults)


def test_a_freed_buffer_is_reused_without_faulting_its_pages_in_again():
    needs_platform(sys.platform.startswith("linux"), "glibc's mallopt")
    applied, kept = _second_round_faults("1")
    assert applied
    # the thread's buffer is the pages the main thread freed: a handful of faults (the thread's stack)
    assert kept < PAGES // 50, kept
    # glibc's defaults: the buffer was unmapped on free, and every page of the new one faults
    applied, default = _second_round_faults("0")
    assert not applied
    assert default > PAGES // 2, default


def test_the_command_keeps_freed_memory_a_caller_of_main_keeps_its_own_allocator():
    needs_platform(sys.platform.startswith("linux"), "glibc's mallopt")
    _, as_command = _second_round_faults("1", CLI.format(argv=""))
    assert as_command < PAGES // 50, as_command
    _, called = _second_round_faults("1", CLI.format(argv='["empatheia", "--help"]'))
    assert called > PAGES // 2, called
