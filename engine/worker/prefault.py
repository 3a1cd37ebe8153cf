"""Fault the KV cache's pages in ahead of the steps, from a background thread, between steps only.

A CPU worker's cache comes from calloc'd pages (engine/model/attention.py `_zeros`): free until
written, so a worker starts in the same time whatever --kv-cache-memory is. But then the first
write to each page faults inside a step. At 64 streams every block boundary (all sequences taking a
fresh block in one step) faulted about 6,000 pages, and those steps took 80-150 ms where the others
took 55-60: 4 or 5 steps in every 64 tokens, the streams' ITL p99. This thread asks the kernel to
populate the pages beforehand (madvise MADV_POPULATE_WRITE, Linux 5.14+), the lowest block ids
first (the block manager hands those out first), a few blocks of every layer at a time, at nice 19,
and only while no step runs (`paused`): running beside the steps, it slowed them (a VM's first touch
of a page is the host's fault too) more than the faults it saved. Where the kernel refuses, pages
fault in as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Iterator

import structlog
import torch

MADV_POPULATE_WRITE = 23  # (Python 3.11's mmap module does not name it)
CHUNK_BYTES = 32 * 1024  # of each tensor per call: short, so a step that begins mid-call waits little

log = structlog.get_logger("worker")


class Prefault:
    """The thread populating `tensors`' pages, block range by block range, once `start`ed and while not
    `paused`; `stop()` ends it early."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.stopped = threading.Event()
        self.idle = threading.Event()  # set while no step runs
        self.idle.set()
        self.thread = threading.Thread(target=self._run, args=(tensors,), name="kv-prefault", daemon=True)

    def start(self) -> Prefault:
        self.thread.start()
        return self

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No new call while inside (a step); one under way finishes, a few pages."""
        self.idle.clear()
        try:
            yield
        finally:
            self.idle.set()

    def stop(self) -> None:
        self.stopped.set()
        self.idle.set()
        if self.thread.is_alive():
            self.thread.join()

    def _run(self, tensors: list[torch.Tensor]) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        rows = max(1, CHUNK_BYTES // (tensors[0][0].numel() * tensors[0].element_size())) if tensors else 1
        for first in range(0, max((len(t) for t in tensors), default=0), rows):
            for tensor in tensors:
                self.idle.wait()
                if self.stopped.is_set():
                    return
                part = tensor[first:first + rows]
                # every page the part touches (a page shared with what is beside it is populated, not changed)
                start = part.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
                end = -(-(part.data_ptr() + part.numel() * part.element_size()) // mmap.PAGESIZE) * mmap.PAGESIZE
                if madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
                    log.info("the kernel does not populate pages ahead; the KV cache's pages fault in as used",
                             error=os.strerror(ctypes.get_errno()))
                    return
