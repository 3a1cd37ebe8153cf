"""A CPU worker's KV cache pages are faulted in by a background thread between steps (engine/worker/prefault.py):
once it has run, the pages are resident and still zero; while a step runs (`paused`) it populates nothing.
Residency is the kernel's own word for each page (mincore)."""

from __future__ import annotations

import ctypes
import mmap
import time

import torch

from engine.worker.prefault import Prefault

libc = ctypes.CDLL(None, use_errno=True)
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def caches(n: int = 2) -> list[torch.Tensor]:
    """n caches of 8 MiB (1,024 blocks of 16 x 2 x 64 float32) in fresh anonymous mappings, none of their pages
    resident yet, each from byte 16 on: what a worker's calloc'd cache is, whatever glibc's heap holds (an
    earlier test's worker may have told it to keep freed memory, engine/worker/heap.py)."""
    shape, size = (1024, 16, 2, 64), 1024 * 16 * 2 * 64
    return [torch.frombuffer(mmap.mmap(-1, 4 * size + mmap.PAGESIZE), dtype=torch.float32, offset=16,
                             count=size).view(shape) for _ in range(n)]


def resident(tensors: list[torch.Tensor]) -> float:
    """The share of the tensors' whole pages that are resident."""
    pages = kept = 0
    for t in tensors:
        start = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (t.data_ptr() + t.numel() * t.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
        vec = ctypes.create_string_buffer((end - start) // mmap.PAGESIZE)
        assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
        pages += len(vec.raw)
        kept += sum(b & 1 for b in vec.raw)
    return kept / pages


def test_the_cache_pages_are_resident_once_it_has_run_and_still_zero():
    tensors = caches()
    assert resident(tensors) < 0.01
    Prefault(tensors).start().thread.join(timeout=60)
    assert resident(tensors) == 1.0
    assert all(not t.any() for t in tensors)


def test_it_populates_nothing_while_a_step_runs_and_goes_on_after():
    tensors = caches()
    prefault = Prefault(tensors)
    with prefault.paused():  # a step
        prefault.start()
        time.sleep(0.3)
        assert resident(tensors) < 0.01
    prefault.thread.join(timeout=60)
    assert resident(tensors) == 1.0


def test_stop_ends_it_before_it_is_done():
    tensors = caches()
    prefault = Prefault(tensors)
    with prefault.paused():
        prefault.start()
        prefault.stop()  # (it releases the pause: the thread finds the stop before its first call)
    assert not prefault.thread.is_alive()
    assert resident(tensors) < 0.01
