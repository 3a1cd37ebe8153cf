"""The shared-memory segment under the broadcast ring: its layout, the wait loop both ends use,
liveness of the peer processes, and removal of rings whose writer died.

See engine/ring/shm_broadcast.py for the ring itself.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Callable

import psutil
import zmq

SHM_DIR = "/dev/shm"
MAGIC = int.from_bytes(b"vsupRng1", "little")
SPIN_S = 100e-6  # spin with sched_yield this long: a worker's next step usually comes within it
MAX_SLEEP_S = 1e-3  # then sleep, doubling up to this
BLOCK_AFTER_S = 20e-3  # idle this long, a reader blocks on the wakeup socket
POLL_S = 0.1  # longest block, and how often a waiter checks that its peers still live
INIT_GRACE_S = 60.0  # a segment still without a header is stale only once this old
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")
PID_WORD, START_WORD, CLOSED_WORD = 4, 5, 6  # header words
UNATTACHED, ATTACHED, DETACHED = 0, 1, 2
FENCE_LOCK = threading.Lock()


class PeerDied(RuntimeError):
    """The process at the other end of the ring died: restart the worker group with a new ring."""


class RingClosed(RuntimeError):
    """The other end closed the ring on purpose."""


def fence() -> None:
    # Python has no memory barrier; an uncontended lock round trip is an atomic read-modify-write,
    # which orders the data copy against the seq store, and the sleep-flag handshake.
    FENCE_LOCK.acquire()
    FENCE_LOCK.release()


def check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(f"{what} {name!r} must be 1-200 letters, digits, '.', '_' or '-'")


def start_ms(pid: int) -> int:
    return int(psutil.Process(pid).create_time() * 1000)


def is_alive(pid: int, start_ms: int) -> bool:
    """False once `pid` is gone, a zombie, or a newer process that reused the number."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() * 1000 - start_ms) < 1000
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


class Layout:
    """Word indices and byte offsets of a segment, computed alike by the writer and every reader."""

    def __init__(self, num_readers: int, num_slots: int, slot_bytes: int):
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        self.first_slot = -(-(8 + 4 * num_readers) // 8) * 64  # whole cache lines
        self.slot_header = -(-(2 + num_readers) // 8) * 64
        # the data of all slots in one run, so that a message that does not wrap is one copy
        self.first_data = self.first_slot + num_slots * self.slot_header
        self.end = self.first_data + num_slots * slot_bytes
        self.size = -(-self.end // 64) * 64

    def reader_word(self, r: int) -> int:
        return 8 + 4 * r

    def slot_word(self, slot: int) -> int:
        return (self.first_slot + slot * self.slot_header) // 8

    def data_offset(self, slot: int) -> int:
        return self.first_data + slot * self.slot_bytes


class RingEnd:
    """What both ends share: the mapping and its word view, the wakeup socket, the wait loop."""

    def __init__(self, name: str, mm: mmap.mmap, layout: Layout, sock: zmq.Socket):
        self.name, self.layout, self._mm, self._sock = name, layout, mm, sock
        self._bytes = memoryview(mm)
        self._words = self._bytes.cast("Q")  # aligned 8-byte loads and stores: never torn on x86-64

    def _wait(self, is_ready: Callable[[], bool], deadline: float | None, check_peers: Callable[[], None],
              block: Callable[[float], None] | None = None) -> bool:
        """Spin, sleep with backoff, then block (if given) until is_ready(); False on timeout."""
        start = now = time.monotonic()
        next_check, delay = start + POLL_S, 10e-6
        while not is_ready():
            if deadline is not None and now >= deadline:
                return False
            if now >= next_check:
                check_peers()
                next_check = now + POLL_S
            if now - start < SPIN_S:
                os.sched_yield()
            elif block is None or now - start < BLOCK_AFTER_S:
                time.sleep(delay)
                delay = min(2 * delay, MAX_SLEEP_S)
            else:
                block(POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - now)))
            now = time.monotonic()
        return True

    def _release(self) -> None:
        self._sock.close(linger=100)  # lets the writer's last wakeup (close) leave
        self._words.release()
        self._bytes.release()
        self._mm.close()
        self._mm = None


def remove_stale(prefix: str) -> list[str]:
    """Delete the `/dev/shm/<prefix>*` rings whose writer is dead (the supervisor calls it after a
    crash); rings of live writers and files that are not rings stay. Returns the names removed."""
    check_name(prefix, "prefix")
    removed = []
    for entry in os.scandir(SHM_DIR):
        try:
            if not entry.name.startswith(prefix):
                continue
            with open(entry.path, "rb") as f:
                magic, *_, pid, start = struct.unpack("<6Q", f.read(48).ljust(48, b"\0"))
            is_orphan = magic == 0 and time.time() - entry.stat().st_mtime > INIT_GRACE_S  # died before writing it
            if not is_alive(pid, start) if magic == MAGIC else is_orphan:
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return removed
