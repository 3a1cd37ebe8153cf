"""glibc's heap told to keep what a CPU worker frees, so that a step's activations reuse last step's pages.

A step on the CPU allocates its activations afresh, layer by layer: at a prefill of 1,024 tokens the MLP's
output alone is 12 MB a layer. glibc serves a block that large with its own mmap and unmaps it when it is
freed (or trims the heap's top back to the kernel), so the next layer's block faults its pages in again, one
4 KiB page at a time: measured here, a 64-prompt prefill step took 440-600 ms with glibc's defaults and
330-400 ms with the settings below, and 64 streams through the server 1.12-1.21x the tokens/s. The worker
sets them once its weights and KV cache are in place, after giving back what loading freed, so that what
the heap keeps from then on is bounded by a step's peak (the cache's pages: engine/worker/prefault.py).
"""

from __future__ import annotations

import ctypes
import platform

import structlog

log = structlog.get_logger("worker")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit: blocks below it come from the heap
TRIM_THRESHOLD = 1 << 30  # the heap's free top given back only past this
TOP_PAD = 64 << 20  # the heap grows by at least this much at a time


def keep_freed_memory() -> bool:
    """Give back what the heap holds free now (what loading the weights freed), then set its thresholds for
    the steps to come; False (and nothing changed) where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    libc.malloc_trim(0)
    done = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if not done:
        log.warning("glibc refused the heap's thresholds; each step faults its activations' pages in")
    return done
