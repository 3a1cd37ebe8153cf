"""The shared-memory broadcast ring, with real reader and writer processes.

Every test leaves no process (tests/conftest.py checks) and no /dev/shm entry (the `prefix` fixture).
"""

from __future__ import annotations

import hashlib
import os
import queue
import random
import secrets
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.ring import shm_broadcast, shm_segment
from engine.ring.shm_broadcast import PeerDied, RingClosed, ShmBroadcastReader, ShmBroadcastWriter, remove_stale

CHILD = r'''
import hashlib, sys, time
from engine.ring.shm_broadcast import ShmBroadcastReader, ShmBroadcastWriter
mode, *args = sys.argv[1:]
say = lambda *words: print(*words, flush=True)
if mode == "write":  # one message, then wait to be killed
    writer = ShmBroadcastWriter.create(args[0], int(args[2]), args[1], slot_bytes=256, num_slots=4)
    say(writer.name)
    writer.wait_for_readers(10)
    writer.enqueue(b"first")
    time.sleep(60)
elif mode == "write-and-exit":  # no close(): atexit must unlink
    say(ShmBroadcastWriter.create(args[0], 1, args[1]).name)
else:
    reader = ShmBroadcastReader.attach(args[0], int(args[1]), args[2])
    say("attached")
    if mode == "read":  # a digest of every message, length-prefixed, in order
        digest = hashlib.blake2b()
        for _ in range(int(args[3])):
            message = reader.dequeue(timeout=30)
            digest.update(len(message).to_bytes(8, "little") + message)
        say(digest.hexdigest())
    elif mode == "hang":
        time.sleep(60)
    elif mode == "idle":
        say(len(reader.dequeue(timeout=30)))
    elif mode == "until-error":
        try:
            while True:
                say("got", reader.dequeue(timeout=30))
        except Exception as e:
            say(type(e).__name__)
    reader.close()
'''


class Children:
    """Child processes running CHILD, with a line reader that cannot hang the test."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.lines: dict[int, queue.Queue] = {}

    def start(self, *args) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)], stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        self.lines[proc.pid] = lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line.rstrip("\n")) for line in proc.stdout], daemon=True).start()
        return proc

    def readline(self, proc: subprocess.Popen, timeout: float = 15) -> str:
        return self.lines[proc.pid].get(timeout=timeout)

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()


@pytest.fixture
def children():
    kids = Children()
    yield kids
    kids.stop()


@pytest.fixture
def prefix():
    """A prefix of this test's own; fails the test if a segment with it outlives the test."""
    name = f"vsup-test-{os.getpid()}-{secrets.token_hex(3)}"
    yield name
    left = [e for e in os.listdir(shm_broadcast.SHM_DIR) if e.startswith(name)]
    for entry in left:
        os.unlink(os.path.join(shm_broadcast.SHM_DIR, entry))
    assert not left, f"left in /dev/shm: {left}"


@pytest.fixture
def address(tmp_path):
    return f"ipc://{tmp_path}/ring-wakeup.sock"


def shm_path(name: str) -> str:
    return os.path.join(shm_broadcast.SHM_DIR, name)


def test_three_readers_get_every_message_in_order(prefix, address, children):
    rng, slot = random.Random(7), 4096
    ring = 8 * slot
    sizes = [0, 1, slot - 1, slot, slot + 1, ring, ring + 1, 3 * ring] + [
        rng.randint(0, slot) if r < 0.7 else rng.randint(slot, 4 * slot) if r < 0.95 else rng.randint(ring, 3 * ring)
        for r in (rng.random() for _ in range(992))]
    writer = ShmBroadcastWriter.create(prefix, 3, address, slot_bytes=slot, num_slots=8)
    try:
        readers = [children.start("read", writer.name, i, address, len(sizes)) for i in range(3)]
        writer.wait_for_readers(timeout=15)
        writer.unlink()
        digest = hashlib.blake2b()
        for size in sizes:
            message = rng.randbytes(size)
            digest.update(len(message).to_bytes(8, "little") + message)
            writer.enqueue(message, timeout=15)
        for proc in readers:
            assert children.readline(proc) == "attached"
            assert children.readline(proc) == digest.hexdigest()
            assert proc.wait(5) == 0
    finally:
        writer.close()


def test_a_killed_reader_makes_the_blocked_writer_raise(prefix, address, children):
    writer = ShmBroadcastWriter.create(prefix, 2, address, slot_bytes=64, num_slots=4)
    try:
        readers = [children.start("hang", writer.name, i, address) for i in range(2)]
        writer.wait_for_readers(timeout=15)
        for _ in range(4):
            writer.enqueue(b"step", timeout=1)
        with pytest.raises(TimeoutError, match=r"readers \[0, 1\]"):
            writer.enqueue(b"step", timeout=0.2)
        readers[1].kill()  # SIGKILL, and left unreaped: a zombie counts as dead
        with pytest.raises(PeerDied, match="reader 1"):  # (not the TimeoutError of waiting it out)
            writer.enqueue(b"step", timeout=60)
    finally:
        writer.close()


def test_a_killed_writer_makes_readers_raise_and_remove_stale_cleans_up(prefix, address, children):
    writer = children.start("write", prefix, address, 2)
    name = children.readline(writer)
    readers = [children.start("until-error", name, i, address) for i in range(2)]
    for proc in readers:
        assert [children.readline(proc), children.readline(proc)] == ["attached", "got b'first'"]
    assert remove_stale(prefix) == [] and os.path.exists(shm_path(name))  # its writer lives
    writer.kill()
    for proc in readers:
        assert children.readline(proc, timeout=60) == "PeerDied"
    writer.wait()
    with pytest.raises(PeerDied, match="writer"):
        ShmBroadcastReader.attach(name, 0, address)
    assert remove_stale(prefix) == [name] and not os.path.exists(shm_path(name))


def test_an_idle_reader_uses_almost_no_cpu(prefix, address, children):
    writer = ShmBroadcastWriter.create(prefix, 1, address, slot_bytes=1024)
    try:
        reader = children.start("idle", writer.name, 0, address)
        writer.wait_for_readers(timeout=15)
        time.sleep(0.3)  # past the spin and the backoff
        proc = psutil.Process(reader.pid)
        cpu, wall = sum(proc.cpu_times()[:2]), time.monotonic()
        time.sleep(1.0)
        share = (sum(proc.cpu_times()[:2]) - cpu) / (time.monotonic() - wall)
        assert share < 0.05, f"an idle reader used {share:.1%} of a core"
        writer.enqueue(b"wake up", timeout=5)
        assert [children.readline(reader), children.readline(reader)] == ["attached", "7"]
        assert reader.wait(5) == 0
    finally:
        writer.close()


def test_a_blocked_reader_is_woken_by_the_socket_not_the_poll_timeout(prefix, address, monkeypatch):
    monkeypatch.setattr(shm_segment, "POLL_S", 120.0)  # a lost wakeup would now outlast the test's wait
    writer = ShmBroadcastWriter.create(prefix, 1, address, slot_bytes=64)
    reader = ShmBroadcastReader.attach(writer.name, 0, address)
    received: queue.Queue = queue.Queue()
    thread = threading.Thread(target=lambda: [received.put((reader.dequeue(timeout=200), time.monotonic()))
                                              for _ in range(3)])
    thread.start()
    try:
        for i in range(3):
            time.sleep(0.1)  # idle past BLOCK_AFTER_S: the reader now blocks on the socket
            writer.enqueue(bytes([i]))
            message, _ = received.get(timeout=60)  # woken by the socket, not the 120 s poll timeout
            assert message == bytes([i])
    finally:
        thread.join(20)
        reader.close()
        writer.close()


def test_timeouts_leave_nothing_half_written(prefix, address):
    writer = ShmBroadcastWriter.create(prefix, 1, address, slot_bytes=16, num_slots=8)
    reader = ShmBroadcastReader.attach(writer.name, 0, address)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no message"):
        reader.dequeue(timeout=0.05)
    assert time.monotonic() - start < 10  # (it gave up: it did not wait on)
    for i in range(6):
        writer.enqueue(bytes([i]) * 16)
    big = bytes(range(64))  # four slots: fits the ring but not the two free slots
    with pytest.raises(TimeoutError, match=r"readers \[0\]"):
        writer.enqueue(big, timeout=0.05)
    assert [reader.dequeue(timeout=1) for _ in range(6)] == [bytes([i]) * 16 for i in range(6)]
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.05)
    writer.enqueue(big, timeout=1)
    assert reader.dequeue(timeout=1) == big
    reader.close()
    writer.close()


def test_a_timeout_inside_a_message_longer_than_the_ring_breaks_the_writer(prefix, address):
    writer = ShmBroadcastWriter.create(prefix, 1, address, slot_bytes=16, num_slots=4)
    reader = ShmBroadcastReader.attach(writer.name, 0, address)
    with pytest.raises(TimeoutError):
        writer.enqueue(bytes(200), timeout=0.05)
    with pytest.raises(RuntimeError, match="broken"):
        writer.enqueue(b"next")
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.05)  # four chunks came, the fifth never will
    writer.close()
    with pytest.raises(RingClosed):
        reader.dequeue(timeout=1)
    reader.close()


def test_a_reader_resumes_a_message_after_a_timeout(prefix, address):
    writer = ShmBroadcastWriter.create(prefix, 1, address, slot_bytes=16, num_slots=2)
    reader = ShmBroadcastReader.attach(writer.name, 0, address)
    messages = [random.Random(i).randbytes(300) for i in range(20)]
    thread = threading.Thread(target=lambda: [writer.enqueue(m, timeout=10) for m in messages])
    thread.start()
    received, timeouts = [], 0
    while len(received) < len(messages):
        try:
            received.append(reader.dequeue(timeout=0))  # often stops between two chunks
        except TimeoutError:
            timeouts += 1
            time.sleep(0)  # hand the GIL to the writer thread now rather than after the 5 ms switch interval
    thread.join(10)
    assert received == messages and timeouts > 0
    reader.close()
    writer.close()


def test_closing_either_end_tells_the_other(prefix, address):
    writer = ShmBroadcastWriter.create(prefix, 2, address, slot_bytes=16, num_slots=2)
    readers = [ShmBroadcastReader.attach(writer.name, i, address) for i in range(2)]
    writer.enqueue(b"a")
    writer.enqueue(b"b")
    assert readers[0].dequeue(timeout=1) == b"a"
    readers[1].close()
    with pytest.raises(RingClosed, match="reader 1"):
        writer.enqueue(b"c", timeout=5)
    writer.close()
    assert readers[0].dequeue(timeout=1) == b"b"  # what was written before close still arrives
    with pytest.raises(RingClosed, match="writer closed"):
        readers[0].dequeue(timeout=1)
    readers[0].close()


def test_unlink_and_close_leave_dev_shm_clean(prefix, address, children):
    writer = ShmBroadcastWriter.create(prefix, 1, address)
    assert os.stat(shm_path(writer.name)).st_mode & 0o777 == 0o600
    assert writer.name.startswith(prefix + "-")
    reader = ShmBroadcastReader.attach(writer.name, 0, address)
    writer.wait_for_readers(timeout=1)
    writer.unlink()
    assert not os.path.exists(shm_path(writer.name))
    writer.enqueue(b"still mapped")
    assert reader.dequeue(timeout=1) == b"still mapped"
    with pytest.raises(FileNotFoundError, match=r"unlink\(\)"):
        ShmBroadcastReader.attach(writer.name, 0, address)
    reader.close()
    writer.close()
    writer.close()
    other = ShmBroadcastWriter.create(prefix, 1, address)
    assert other.name != writer.name and os.path.exists(shm_path(other.name))
    other.close()  # unlinks without an unlink() first
    child = children.start("write-and-exit", prefix, address)
    name = children.readline(child)
    assert child.wait(10) == 0 and not os.path.exists(shm_path(name))  # atexit unlinked it


def test_bad_arguments_raise_clear_errors(prefix, address):
    with pytest.raises(ValueError, match="prefix"):
        ShmBroadcastWriter.create("../etc", 1, address)
    with pytest.raises(ValueError, match="at least 1"):
        ShmBroadcastWriter.create(prefix, 0, address)
    writer = ShmBroadcastWriter.create(prefix, 2, address, slot_bytes=64)
    try:
        with pytest.raises(ValueError, match="out of range"):
            ShmBroadcastReader.attach(writer.name, 2, address)
        ShmBroadcastReader.attach(writer.name, 1, address).close()
        with pytest.raises(RuntimeError, match="attached before"):
            ShmBroadcastReader.attach(writer.name, 1, address)
        with pytest.raises(TimeoutError, match=r"readers \[0\]"):
            writer.wait_for_readers(timeout=0.05)
        with pytest.raises(ValueError, match="wakeup socket"):
            ShmBroadcastWriter.create(prefix, 1, "nonsense://here")
    finally:
        writer.close()
    with open(shm_path(f"{prefix}-junk"), "wb") as f:
        f.write(b"not a ring" * 10)
    with pytest.raises(ValueError, match="not a vsup broadcast ring"):
        ShmBroadcastReader.attach(f"{prefix}-junk", 0, address)
    assert remove_stale(prefix) == []  # not ours: left alone
    os.unlink(shm_path(f"{prefix}-junk"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(slot_bytes=st.integers(1, 48), num_slots=st.integers(1, 5), num_readers=st.integers(1, 3),
       sizes=st.lists(st.integers(0, 300), max_size=12))
def test_any_message_sizes_round_trip(prefix, slot_bytes, num_slots, num_readers, sizes):
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/w.sock"
        writer = ShmBroadcastWriter.create(prefix, num_readers, address, slot_bytes=slot_bytes, num_slots=num_slots)
        readers = [ShmBroadcastReader.attach(writer.name, i, address) for i in range(num_readers)]
        for i, size in enumerate(sizes):
            message = bytes((i + j) % 251 for j in range(size % (slot_bytes * num_slots + 1)))
            writer.enqueue(message, timeout=1)
            assert all(reader.dequeue(timeout=1) == message for reader in readers)
        for reader in readers:
            reader.close()
        writer.close()
