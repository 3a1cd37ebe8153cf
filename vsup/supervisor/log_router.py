"""Read every child's stdout and stderr, tag each line, write it to vsup.jsonl and the console.

One thread with one selector over all pipes; the main thread hands it new
pipes through a wakeup pipe, so the selector is only touched by its thread.
"""

from __future__ import annotations

import json
import os
import queue
import selectors
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, TextIO

import msgspec

from vsup.messages import Hello, decode
from vsup.supervisor.log_format import is_load_report, now_iso, render, supervisor_record, tag_json_lines, tag_line

LISTEN, HELLO, DROP = "listen", "hello", "drop"  # a hook socket, a connection not yet introduced, a bad one
ROTATE_BYTES = 16 << 20
KEEP_FILES = 5
TAIL = 30  # each process's last lines, kept for an incident


class JsonlWriter:
    """Append records to vsup.jsonl; past ROTATE_BYTES, shift to vsup.jsonl.1 ... .KEEP_FILES.

    Records collect in memory until `flush()` (the router flushes after each read of a pipe, and after
    each record of the supervisor's own), so a burst of lines costs one encode and one write, not one a
    line. A file rotates after the batch that takes it past its size."""

    def __init__(self, path: Path, rotate_bytes: int = ROTATE_BYTES, keep: int = KEEP_FILES):
        self.path, self.rotate_bytes, self.keep = path, rotate_bytes, keep
        self.encode_lines = msgspec.json.Encoder(enc_hook=str).encode_lines  # anything else JSON cannot hold, as text
        self.pending: list[bytes] = []
        self.fd = self._open()
        self.size = os.fstat(self.fd).st_size

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def write(self, records: list[dict]) -> None:
        data = self.encode_lines(records)
        self.pending.append(data)
        self.size += len(data)
        if self.size >= self.rotate_bytes:
            self.flush()
            os.close(self.fd)
            for i in range(self.keep - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    older.rename(self.path.with_name(f"{self.path.name}.{i + 1}"))
            self.path.rename(self.path.with_name(f"{self.path.name}.1"))
            self.fd, self.size = self._open(), 0

    def flush(self) -> None:
        data = memoryview(b"".join(self.pending))
        self.pending.clear()
        while data:
            data = data[os.write(self.fd, data):]

    def close(self) -> None:
        self.flush()
        os.close(self.fd)


class Console:
    """Text with aligned (coloured on a TTY) prefixes, or the JSON records themselves.

    A console nobody reads (a full pipe, a paused terminal) must never stall
    the supervisor or, through the router, the children's pipes: lines go
    through a bounded queue to a thread of their own, and are dropped, and
    counted, when it is full. vsup.jsonl keeps every line regardless.
    """

    def __init__(self, stream: TextIO = sys.stdout, fmt: str = "auto", max_pending: int = 10_000):
        self.stream = stream
        self.json = fmt == "json"
        self.color = fmt == "auto" and stream.isatty()
        self.width = 10
        self.pending: queue.Queue = queue.Queue(max_pending)
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="console", daemon=True)
        self.thread.start()

    def write(self, records: list[dict]) -> None:
        for record in records:
            try:
                self.pending.put_nowait(record)
            except queue.Full:
                self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        """Print what is still queued (for at most `timeout`), and say what was dropped."""
        self.pending.put(None)
        self.thread.join(timeout)
        if self.dropped and not self.thread.is_alive():
            self.stream.write(f"({self.dropped} lines were not shown here; all are in vsup.jsonl)\n")
            self.stream.flush()

    def _run(self) -> None:
        while (record := self.pending.get()) is not None:
            text = json.dumps(record, default=str) if self.json else render(record, self.width, self.color)
            try:
                self.stream.write(text + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                return  # the console went away (closed pipe): keep running without it


class LogRouter(threading.Thread):
    """Pumps lines from child pipes to the sinks until stopped."""

    def __init__(self, sinks: list[Callable[[list[dict]], None]], flushes: list[Callable[[], None]] = ()):
        """`sinks` take each batch of records, in order; `flushes` are called after each (JsonlWriter.flush)."""
        super().__init__(name="log-router", daemon=True)
        self.sinks, self.flushes = sinks, list(flushes)
        self.lock = threading.Lock()  # the main thread emits its own records too
        self.selector = selectors.DefaultSelector()
        self.pending: deque = deque()
        self.wake_r, self.wake_w = os.pipe()
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)
        self.stopping = False
        self.open_pipes = 0
        self.last_stderr: dict[str, deque[str]] = {}  # process name -> its last stderr lines and logged errors
        self.last_said: dict[str, tuple[float, str]] = {}  # process name -> when (monotonic) and what it last said
        self.tails: dict[str, deque[tuple[float, dict]]] = {}  # process name -> its last records (incidents)
        self.on_load: Callable[[dict], None] | None = None  # takes the children's load reports instead of the sinks

    def last_lines(self, name: str) -> list[str]:
        """From any thread: the last stderr lines and logged errors of process `name` (for its exit message)."""
        for _ in range(3):
            try:
                return list(self.last_stderr.get(name, ()))
            except RuntimeError:  # (this thread appended to it meanwhile)
                continue
        return []

    def tail(self, name: str) -> list[tuple[float, int, str]]:
        """From any thread: process `name`'s last TAIL lines, each (monotonic time, pid, `LEVEL text`)."""
        for _ in range(3):
            try:
                kept = list(self.tails.get(name, ()))
                break
            except RuntimeError:  # (the router's thread appended to it meanwhile)
                continue
        else:
            return []
        return [(at, r.get("pid"), f"{r.get('level') or 'info'} {r.get('event')}" +
                 (f": {said}" if (said := r.get("error") or r.get("exception")) else "")) for at, r in kept]

    def emit(self, record: dict) -> None:
        self.emit_all([record])

    def emit_all(self, records: list[dict]) -> None:
        """The records to every sink, then flush: one batch, one lock."""
        with self.lock:
            for sink in self.sinks:
                sink(records)
            for f in self.flushes:
                f()

    def add(self, pipe: int, stream: str, tag: dict) -> None:
        """Read `pipe` (a child's stdout or stderr) from now on, tagging lines with `tag`."""
        self.pending.append((pipe, stream, tag))
        os.write(self.wake_w, b"x")

    def listen(self, sock, on_hello: Callable[[Hello], None], tagger: Callable[[str, str, Hello], dict]) -> None:
        """Accept the start-up hook's connections on `sock` (a stock vLLM's processes, vsup/vllm/hook):
        each opens with one JSON line {"pid", "ppid", "stream"}, handed to `on_hello`; every later line
        becomes the record `tagger(line, stream, hello)`."""
        self.on_hello, self.tagger = on_hello, tagger
        self.pending.append((sock, LISTEN, None))
        os.write(self.wake_w, b"x")

    def stop(self) -> None:
        """Drain what the pipes still hold, then end the thread."""
        self.stopping = True
        os.write(self.wake_w, b"x")
        self.join(timeout=5)

    def run(self) -> None:
        buffers: dict[int, bytearray] = {}
        while not (self.stopping and self.open_pipes == 0):
            for key, _ in self.selector.select(timeout=0.5 if self.stopping else None):
                if key.data is None:
                    os.read(self.wake_r, 4096)
                    while self.pending:
                        pipe, stream, tag = self.pending.popleft()
                        if stream == LISTEN:
                            self.selector.register(pipe, selectors.EVENT_READ, (LISTEN, pipe))
                            continue
                        os.set_blocking(pipe, False)
                        self.selector.register(pipe, selectors.EVENT_READ, (stream, tag))
                        buffers[pipe] = bytearray()
                        self.open_pipes += 1
                    continue
                if key.data[0] == LISTEN:
                    self._accept(key.data[1], buffers)
                    continue
                pipe, (stream, tag) = key.fd, key.data
                try:
                    chunk = os.read(pipe, 65536)
                except BlockingIOError:
                    continue
                buf = buffers[pipe]
                buf += chunk
                if not chunk:  # EOF: the child closed it (it exited); its last line may lack a newline
                    buf += b"\n" if buf else b""
                    self.selector.unregister(pipe)
                    os.close(pipe)
                    self.open_pipes -= 1
                end = buf.rfind(b"\n") + 1  # what is after it waits for the rest of its line
                if not end:
                    continue
                whole = bytes(buf[:end])
                del buf[:end]
                records = self._records(whole, stream, tag, pipe, chunk)
                if records:
                    self.emit_all(records)
            if self.stopping and not self.selector.select(timeout=0):
                break

    def _accept(self, sock, buffers: dict) -> None:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        fd = conn.detach()
        os.set_blocking(fd, False)
        self.selector.register(fd, selectors.EVENT_READ, (HELLO, None))
        buffers[fd] = bytearray()
        self.open_pipes += 1

    def _hello(self, raw: bytes, fd: int, chunk: bytes) -> tuple[str, dict | None]:
        """Read a hook connection's first line; a malformed one is logged and its lines dropped."""
        try:
            hello = decode(raw, Hello)
        except ValueError as e:
            self.emit(supervisor_record("malformed hook hello dropped", "warning", error=str(e)[:200]))
            stream, tag = DROP, None
        else:
            self.on_hello(hello)
            stream, tag = hello.stream, {"hello": hello}
        if chunk:  # still open: later reads carry the new stream and tag
            self.selector.modify(fd, selectors.EVENT_READ, (stream, tag))
        return stream, tag

    def _records(self, whole: bytes, stream: str, tag: dict | None, fd: int, chunk: bytes) -> list[dict]:
        """The records of whole lines read from `fd` for the sinks."""
        arrived = now_iso()  # the time of every line of this read that does not say its own
        if stream == "stdout" and "hello" not in tag:  # a child of our engine: JSON lines, tagged in one go
            records = tag_json_lines(whole, stream, tag, arrived)
            if records is not None:
                return [record for record in records if self._kept(record, stream, None)]
        records = []
        for raw in whole.split(b"\n")[:-1]:
            if stream == HELLO:  # a hook connection's first line says whose it is
                stream, tag = self._hello(raw, fd, chunk)
                continue
            line = raw.decode(errors="replace").rstrip("\r")
            if not line or line.isspace() or stream == DROP:
                continue
            record = (self.tagger(line, stream, tag["hello"]) if "hello" in tag
                      else tag_line(line, stream, tag, arrived))
            if self._kept(record, stream, line):
                records.append(record)
        return records

    def _kept(self, record: dict, stream: str, line: str | None) -> bool:
        """Whether a record goes to the sinks: not a load report (handed to `on_load`). Keeps a process's
        last stderr lines and logged errors for its exit message."""
        if self.on_load is not None and is_load_report(record):
            self.on_load(record)
            return False
        now = time.monotonic()
        self.last_said[record.get("name")] = (now, str(record.get("event"))[:80])
        self.tails.setdefault(record.get("name"), deque(maxlen=TAIL)).append((now, record))
        if stream == "stderr":
            self.last_stderr.setdefault(record["name"], deque(maxlen=20)).append(line)
        elif record.get("level") in ("error", "critical"):  # a child's own last words, logged as JSON
            said = record.get("error") or record.get("exception")
            self.last_stderr.setdefault(record["name"], deque(maxlen=20)).append(
                f"{record.get('event')}: {said}" if said else str(record.get("event")))
        return True
