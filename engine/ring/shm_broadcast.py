"""Shared-memory broadcast ring: the engine core writes each step once, its TP x PP workers all read it.

Segment `/dev/shm/<prefix>-<nonce>` (mode 0600), in 8-byte words, then data:
    header  magic, num_readers, num_slots, slot_bytes, writer pid, writer start, is_closed, spare;
            per reader: pid, start, state (unattached / attached / detached), is_sleeping
    slot i  seq (number of the chunk it holds, 0 = none), msg_len, one read_seq per reader (padded
            to 64 bytes); then the data of all slots, slot_bytes each, in one run
A message is ceil(len / slot_bytes) chunks (at least one) with consecutive seqs in consecutive
slots; a slot is free once every reader's read_seq reached its seq. Sequence numbers rather than
flags mean no flag is ever reset, so there is no reset to race with. A message that fits the ring
is copied out at once; a longer one streams through it chunk by chunk.

Waiting spins ~100 us, sleeps with backoff, then blocks on a ZeroMQ SUB socket, to which the writer
publishes after a write only while some reader says it sleeps. Shared memory stays the source of
truth: a lost wakeup costs one poll timeout, never a message.
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
import struct
import time
from collections.abc import Iterable

import zmq

from engine.ring.shm_segment import (ATTACHED, CLOSED_WORD, DETACHED, Layout, MAGIC, PID_WORD, PeerDied, RingClosed,
                                     RingEnd, SHM_DIR, START_WORD, UNATTACHED, check_name, fence, is_alive,
                                     remove_stale, start_ms)

__all__ = ["ShmBroadcastWriter", "ShmBroadcastReader", "PeerDied", "RingClosed", "remove_stale"]


class ShmBroadcastWriter(RingEnd):
    """The engine core's end: creates the segment and writes each message once for all readers."""

    @classmethod
    def create(cls, prefix: str, num_readers: int, wakeup_address: str, slot_bytes: int = 1 << 20,
               num_slots: int = 8, ctx: zmq.Context | None = None) -> ShmBroadcastWriter:
        """Create `/dev/shm/<prefix>-<nonce>` and bind the wakeup PUB socket at `wakeup_address`."""
        check_name(prefix, "prefix")
        if min(num_readers, slot_bytes, num_slots) < 1:
            raise ValueError(f"num_readers={num_readers}, slot_bytes={slot_bytes} and num_slots={num_slots} "
                             "must all be at least 1")
        layout = Layout(num_readers, num_slots, slot_bytes)
        name = f"{prefix}-{secrets.token_hex(6)}"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the umask could only have narrowed it: make it exact
            os.posix_fallocate(fd, 0, layout.size)  # ENOSPC now rather than SIGBUS on a later write
            mm = mmap.mmap(fd, layout.size)
        except OSError as e:
            os.unlink(os.path.join(SHM_DIR, name))
            raise OSError(e.errno, f"cannot create a {layout.size}-byte ring in {SHM_DIR}: {e.strerror} "
                          "(lower slot_bytes or num_slots, or enlarge /dev/shm; docker: --shm-size)") from None
        finally:
            os.close(fd)
        words = [MAGIC, num_readers, num_slots, slot_bytes, os.getpid(), start_ms(os.getpid())]
        mm[:48] = struct.pack("<6Q", *words)
        return cls(name, mm, layout, (ctx or zmq.Context.instance()).socket(zmq.PUB), wakeup_address)

    def __init__(self, name: str, mm: mmap.mmap, layout: Layout, sock: zmq.Socket, wakeup_address: str):
        super().__init__(name, mm, layout, sock)
        self._owner_pid = os.getpid()  # a forked child must not unlink its parent's ring
        self._next_seq, self._is_broken = 1, False
        self._sleep_words = [layout.reader_word(r) + 3 for r in range(layout.num_readers)]
        atexit.register(self.close)
        try:
            sock.bind(wakeup_address)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"cannot bind the ring's wakeup socket at {wakeup_address!r}: {e}") from None

    def wait_for_readers(self, timeout: float | None = None) -> None:
        """Block until every reader attached; after it, unlink() may remove the name."""
        state = [self.layout.reader_word(r) + 2 for r in range(self.layout.num_readers)]
        deadline = None if timeout is None else time.monotonic() + timeout
        everyone = range(self.layout.num_readers)
        if not self._wait(lambda: all(self._words[w] != UNATTACHED for w in state), deadline,
                          lambda: self._check_readers(everyone)):
            missing = [r for r, w in enumerate(state) if self._words[w] == UNATTACHED]
            raise TimeoutError(f"readers {missing} of ring {self.name!r} did not attach within {timeout} s")
        self._check_readers(everyone)

    def enqueue(self, data: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Write one message for every reader. TimeoutError leaves nothing half-written, except for a
        message longer than the whole ring, after which the ring is broken and must be replaced."""
        if self._mm is None or self._is_broken:
            raise RuntimeError(f"ring {self.name!r} is {'closed' if self._mm is None else 'broken'}: create a new one")
        view, layout = memoryview(data).cast("B"), self.layout
        num_chunks = max(1, -(-view.nbytes // layout.slot_bytes))
        deadline = None if timeout is None else time.monotonic() + timeout
        first = self._next_seq
        self._wait_free(first + min(num_chunks, layout.num_slots) - 1, deadline)
        for c in range(num_chunks):
            seq = first + c
            if c >= layout.num_slots:  # longer than the ring: stream it behind the readers
                self._is_broken = True
                self._wait_free(seq, deadline)
                self._is_broken = False
            slot = (seq - 1) % layout.num_slots
            offset, part = layout.data_offset(slot), view[c * layout.slot_bytes:(c + 1) * layout.slot_bytes]
            fence()
            self._mm[offset:offset + part.nbytes] = part
            word = layout.slot_word(slot)
            self._words[word + 1] = view.nbytes
            fence()
            self._words[word], self._next_seq = seq, seq + 1
            self._wake_sleepers()

    def _wait_free(self, seq: int, deadline: float | None) -> None:
        """Wait until chunk `seq` may be written: every reader read what its slot holds."""
        held = seq - self.layout.num_slots
        base = self.layout.slot_word((seq - 1) % self.layout.num_slots) + 2
        behind = lambda: [r for r in range(self.layout.num_readers) if self._words[base + r] < held]  # noqa: E731
        if held > 0 and not self._wait(lambda: not behind(), deadline, lambda: self._check_readers(behind())):
            raise TimeoutError(f"readers {behind()} of ring {self.name!r} did not read in time")

    def _check_readers(self, readers: Iterable[int]) -> None:
        for r in readers:
            word = self.layout.reader_word(r)
            pid, start, state = self._words[word], self._words[word + 1], self._words[word + 2]
            if state == DETACHED:
                raise RingClosed(f"reader {r} (pid {pid}) closed ring {self.name!r}")
            if state == ATTACHED and not is_alive(pid, start):
                raise PeerDied(f"reader {r} (pid {pid}) of ring {self.name!r} died")

    def _wake_sleepers(self) -> None:
        fence()  # our seq store before we read their flags; sleeping readers do the reverse
        if any(self._words[w] for w in self._sleep_words):
            try:
                self._sock.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a full queue holds a wakeup already

    def unlink(self) -> None:
        """Remove the name from /dev/shm: attached readers keep working, new ones cannot attach."""
        if os.getpid() == self._owner_pid:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass

    def close(self, tell_readers: bool = True) -> None:
        """Tell readers the ring is closed (unless `tell_readers` is False: they find the writer dead
        once it has exited), unmap it and remove its name; also runs at exit."""
        if self._mm is None:
            return
        atexit.unregister(self.close)
        if os.getpid() == self._owner_pid:
            if tell_readers:
                self._words[CLOSED_WORD] = 1
                self._wake_sleepers()
            self.unlink()
        self._release()


class ShmBroadcastReader(RingEnd):
    """A worker's end: attaches to a ring by name and reads every message once, in order."""

    @classmethod
    def attach(cls, name: str, reader_index: int, wakeup_address: str,
               ctx: zmq.Context | None = None) -> ShmBroadcastReader:
        """Map ring `name` as reader `reader_index` and subscribe to its wakeups at `wakeup_address`."""
        check_name(name, "ring name")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"no ring {name!r} in {SHM_DIR}: its writer exited or already called "
                                    "unlink() (readers must attach before wait_for_readers returns)") from None
        try:
            magic, num_readers, num_slots, slot_bytes = struct.unpack("<4Q", os.pread(fd, 32, 0).ljust(32, b"\0"))
            layout = Layout(num_readers, num_slots, slot_bytes)
            if magic != MAGIC or layout.size != os.fstat(fd).st_size:
                raise ValueError(f"{SHM_DIR}/{name} is not a vsup broadcast ring")
            if not 0 <= reader_index < num_readers:
                raise ValueError(f"reader_index {reader_index} is out of range: ring {name!r} has {num_readers} readers")
            mm = mmap.mmap(fd, layout.size)
        finally:
            os.close(fd)
        sock = (ctx or zmq.Context.instance()).socket(zmq.SUB)
        sock.setsockopt(zmq.CONFLATE, 1)  # one pending wakeup says all there is to say
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(wakeup_address)
        return cls(name, mm, layout, sock, reader_index)

    def __init__(self, name: str, mm: mmap.mmap, layout: Layout, sock: zmq.Socket, reader_index: int):
        super().__init__(name, mm, layout, sock)
        self.reader_index, word = reader_index, layout.reader_word(reader_index)
        self._state_word, self._sleep_word = word + 2, word + 3
        try:
            self._check_writer()  # a ring left behind by a crash
        except PeerDied:
            self._release()
            raise
        if self._words[self._state_word] != UNATTACHED:
            pid = self._words[word]
            self._release()
            raise RuntimeError(f"reader {reader_index} of ring {name!r} was attached before (pid {pid}); "
                               "a restarted worker group needs a new ring")
        self._words[word], self._words[word + 1] = os.getpid(), start_ms(os.getpid())
        fence()
        self._words[self._state_word] = ATTACHED
        self._next_seq, self._parts, self._remaining, self._is_sleeping = 1, [], None, False

    def dequeue(self, timeout: float | None = None) -> bytes:
        """Return the next message. TimeoutError if it did not come within `timeout` s (calling again
        resumes, even mid-message), PeerDied if the writer died, RingClosed once it closed the ring."""
        if self._mm is None:
            raise RuntimeError(f"reader {self.reader_index} of ring {self.name!r} is closed")
        deadline, layout = None if timeout is None else time.monotonic() + timeout, self.layout
        try:
            if self._remaining is None:  # a new message: its first chunk says how long it is
                first = self._next_seq
                length = self._words[self._wait_chunk(first, deadline, timeout) + 1]
                num_chunks = max(1, -(-length // layout.slot_bytes))
                if num_chunks <= layout.num_slots:  # all of it fits: wait for its last chunk, copy once
                    self._wait_chunk(first + num_chunks - 1, deadline, timeout)
                    return self._copy_out(first, num_chunks, length)
                self._remaining = length  # longer than the ring: take it chunk by chunk
            while self._remaining:
                seq, take = self._next_seq, min(self._remaining, layout.slot_bytes)
                self._wait_chunk(seq, deadline, timeout)
                offset = layout.data_offset((seq - 1) % layout.num_slots)
                self._parts.append(self._mm[offset:offset + take])
                self._mark_read(seq, 1)
                self._remaining -= take
        finally:
            if self._is_sleeping:
                self._words[self._sleep_word], self._is_sleeping = 0, False
        parts, self._parts, self._remaining = self._parts, [], None
        return b"".join(parts)

    def _wait_chunk(self, seq: int, deadline: float | None, timeout: float | None) -> int:
        word = self.layout.slot_word((seq - 1) % self.layout.num_slots)
        if not self._wait(lambda: self._is_written(word, seq), deadline, self._check_writer, self._block):
            raise TimeoutError(f"no message on ring {self.name!r} within {timeout} s")
        fence()  # the seq before the data it vouches for
        assert self._words[word] == seq, "the writer overwrote a slot before this reader read it"
        return word

    def _copy_out(self, first: int, num_chunks: int, length: int) -> bytes:
        layout = self.layout
        offset = layout.data_offset((first - 1) % layout.num_slots)
        wrap = offset + length - layout.end
        data = (self._mm[offset:offset + length] if wrap <= 0 else
                self._mm[offset:layout.end] + self._mm[layout.first_data:layout.first_data + wrap])
        self._mark_read(first, num_chunks)
        return data

    def _mark_read(self, first: int, num_chunks: int) -> None:
        fence()  # our copy is done before the writer may reuse the slots
        for seq in range(first, first + num_chunks):
            self._words[self.layout.slot_word((seq - 1) % self.layout.num_slots) + 2 + self.reader_index] = seq
        self._next_seq = first + num_chunks

    def _is_written(self, word: int, seq: int) -> bool:
        if self._words[word] >= seq:
            return True
        if self._words[CLOSED_WORD]:
            fence()  # the writer stored its last seq before is_closed: look once more
            if self._words[word] >= seq:
                return True
            raise RingClosed(f"the writer closed ring {self.name!r}")
        return False

    def abandoned(self) -> bool:
        """Whether the writer closed the ring or died; another thread may ask (ValueError once closed here)."""
        words = self._words
        return bool(words[CLOSED_WORD]) or not is_alive(words[PID_WORD], words[START_WORD])

    def _check_writer(self) -> None:
        pid, start = self._words[PID_WORD], self._words[START_WORD]
        if not is_alive(pid, start):
            raise PeerDied(f"the writer (engine core, pid {pid}) of ring {self.name!r} died")

    def _block(self, timeout_s: float) -> None:
        if not self._is_sleeping:
            self._words[self._sleep_word], self._is_sleeping = 1, True
            fence()
            return  # look at the ring once more: a write made before the writer saw the flag sent no wakeup
        if self._sock.poll(int(timeout_s * 1000)):
            self._sock.recv(zmq.NOBLOCK)

    def close(self) -> None:
        """Mark this reader detached (a writer waiting on it raises RingClosed) and unmap it."""
        if self._mm is not None:
            self._words[self._sleep_word], self._words[self._state_word] = 0, DETACHED
            self._release()
