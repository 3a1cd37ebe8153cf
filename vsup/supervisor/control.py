"""The control socket: `vsup ps`, `stop` and `restart` ask the running supervisor over it.

A Unix stream socket (0600) in the run dir; one JSON request line, one JSON
answer line per connection. Connections are read without blocking, on the
supervisor's loop (loop.py), so a slow client holds up nothing. A request that
is no JSON object, longer than MAX_REQUEST_BYTES or slower than
REQUEST_TIMEOUT_S in all is answered with an error and logged: the
supervisor must not die of it nor wait on it.
"""

from __future__ import annotations

import json
import os
import socket
import time

import psutil

from vsup import procfs
from vsup.devices import gpu_processes
from vsup.diagnosis import diagnose, load_figures
from vsup.messages import ControlRequest, decode

MAX_REQUEST_BYTES = 64 << 10
REQUEST_TIMEOUT_S = 2.0


class ControlServer:
    def __init__(self, path: str, supervisor, loop):
        """`supervisor` answers (snapshot, request_stop, request_restart, log); `loop` (loop.Loop) reads."""
        self.path, self.supervisor, self.loop = path, supervisor, loop
        self.sock = listen_unix(path)
        self.sock.setblocking(False)
        self.procs: dict[int, psutil.Process] = {}
        self.open: dict[socket.socket, bytearray] = {}
        loop.watch(self.sock.fileno(), self.accept)

    def accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, OSError):
            return
        conn.setblocking(False)
        self.open[conn] = bytearray()
        self.loop.watch(conn.fileno(), lambda: self.read(conn))
        self.loop.at(time.monotonic() + REQUEST_TIMEOUT_S, lambda: self.expire(conn))

    def read(self, conn: socket.socket) -> None:
        data = self.open.get(conn)
        if data is None:
            return
        try:
            chunk = conn.recv(MAX_REQUEST_BYTES)
        except BlockingIOError:
            return
        except OSError as e:
            self.answer(conn, {"error": f"bad request: {e}"})
            return
        data += chunk
        line, newline, _ = bytes(data).partition(b"\n")
        if len(line) > MAX_REQUEST_BYTES:
            self.answer(conn, {"error": f"bad request: longer than {MAX_REQUEST_BYTES} bytes"})
        elif newline or not chunk:
            try:
                answer = self.handle(decode(line, ControlRequest))
            except ValueError as e:  # (msgspec's errors are ValueErrors)
                answer = {"error": f"bad request: {e}"}
            self.answer(conn, answer)

    def expire(self, conn: socket.socket) -> None:
        if conn in self.open:
            self.answer(conn, {"error": f"bad request: no whole line within {REQUEST_TIMEOUT_S:g} s"})

    def answer(self, conn: socket.socket, answer: dict) -> None:
        """Send the answer line (what the client's buffer takes at once) and close the connection."""
        self.open.pop(conn, None)
        self.loop.forget(conn.fileno())
        if "error" in answer:
            self.supervisor.log("dropped malformed message", "warning", socket="control", error=answer["error"][:300])
        with conn:
            try:
                conn.settimeout(0.2)  # a local reader takes a small answer at once; a stalled one is dropped
                conn.sendall((json.dumps(answer) + "\n").encode())
            except OSError:
                pass  # the client went away

    def handle(self, request: ControlRequest) -> dict:
        if request.cmd == "ps":
            return self.ps()
        if request.cmd == "loads":  # what the API servers' /metrics show of every process (engine/load.py)
            now = time.time()
            return {"loads": {c["name"]: {"role": c["role"], **figures} for c in self.supervisor.snapshot()["processes"]
                              if c.get("pid") and (figures := load_figures(self.supervisor.loads.get(c["name"]),
                                                                           c["pid"], now))}}
        if request.cmd == "stop":
            self.supervisor.request_stop("vsup stop")
            return {"ok": True, "pid": os.getpid()}
        restarted = self.supervisor.request_restart(request.role, request.dp, request.replica, request.rolling,
                                                    now=request.now)
        return {"ok": bool(restarted), "units": restarted}

    def ps(self) -> dict:
        """The snapshot plus what psutil sees of each live process (CPU% since the last ps, RSS, the CPUs
        it may run on), what it
        last reported it is busy with (`load`), and the diagnosis of it all."""
        state = self.supervisor.snapshot()
        now = time.time()
        for p in state["processes"]:
            pid = p.get("pid")
            p["cpu_percent"] = p["rss_bytes"] = p["cpus"] = None
            if pid is None:
                continue
            p["load"] = load_figures(self.supervisor.loads.get(p["name"]), pid, now)
            try:
                proc = self.procs.get(pid) or self.procs.setdefault(pid, psutil.Process(pid))
                with proc.oneshot():
                    p["cpu_percent"] = proc.cpu_percent(None)
                    p["rss_bytes"] = proc.memory_info().rss
                    p["cpus"] = sorted(proc.cpu_affinity())
            except psutil.Error:
                pass
        self.add_gpu_memory(state)
        state["diagnosis"] = diagnose(state["processes"])
        return state

    @staticmethod
    def add_gpu_memory(state: dict) -> None:
        """On CUDA: each process's memory on its GPU as the driver counts it, and every *other* process
        that holds memory on the deployment's GPUs (`gpu_others`): who is left holding GPU memory."""
        ours = {p["pid"]: p for p in state["processes"] if p.get("pid")}
        gpus = {int(d.split(":")[1]) for p in state["processes"] if (d := p.get("device") or "").startswith("cuda:")}
        if not gpus:
            return
        state["gpu_others"] = []
        for holder in gpu_processes():
            if holder["pid"] in ours:
                process = ours[holder["pid"]]
                process["device_memory_bytes"] = process.get("device_memory_bytes", 0) + holder["bytes"]
            elif holder["gpu"] in gpus:
                state["gpu_others"].append({**holder, "cmdline": procfs.cmdline(holder["pid"])})

    def close(self) -> None:
        for conn in list(self.open):
            self.open.pop(conn)
            self.loop.forget(conn.fileno())
            conn.close()
        self.loop.forget(self.sock.fileno())
        self.sock.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


def listen_unix(path: str, backlog: int = 16) -> socket.socket:
    """A listening Unix stream socket at `path`, mode 0600 whatever the umask. A file already there is a
    dead supervisor's leftover: the run dir lock says nobody else holds it."""
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(backlog)
    return sock
