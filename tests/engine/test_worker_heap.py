"""The CPU worker's heap: after keep_freed_memory() a step-sized block comes from glibc's heap, not its own
mmap, and freeing it keeps the pages for the next step (a fresh interpreter each, so the test's own heap
is not touched)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, sys
from engine.worker import heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "keep":
    assert heap.keep_freed_memory()
block = 16 << 20  # a prefill's MLP output at 1,024 tokens is about this
before = libc.mallinfo2()
p = libc.malloc(block)
during = libc.mallinfo2()
libc.free(p)
after = libc.mallinfo2()
print(during.hblks - before.hblks, after.arena + after.hblkhd >= block)
"""


def probe(mode: str) -> tuple[int, bool]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    mapped, kept = out.split()
    return int(mapped), kept == "True"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_step_sized_block_stays_in_the_heap():
    assert probe("default") == (1, False)  # glibc's default: its own mmap, unmapped when freed
    assert probe("keep") == (0, True)  # from the heap, and kept for the next step
