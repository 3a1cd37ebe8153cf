"""The control socket: `vsup ps`, `stop` and `restart` ask the running supervisor over it.

A Unix stream socket (0600) in the run dir; one JSON request line, one JSON
answer line per connection.
"""

from __future__ import annotations

import json
import os
import socket

import psutil


class ControlServer:
    def __init__(self, path: str, supervisor):
        self.path, self.supervisor = path, supervisor
        self.sock = listen_unix(path)
        self.sock.setblocking(False)
        self.procs: dict[int, psutil.Process] = {}

    def accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return
        with conn:
            conn.settimeout(2.0)
            try:
                request = json.loads(conn.makefile().readline() or "{}")
                answer = self.handle(request)
            except (OSError, ValueError) as e:
                answer = {"error": f"bad request: {e}"}
            try:
                conn.sendall((json.dumps(answer) + "\n").encode())
            except OSError:
                pass  # the client went away

    def handle(self, request: dict) -> dict:
        cmd = request.get("cmd")
        if cmd == "ps":
            return self.ps()
        if cmd == "stop":
            self.supervisor.request_stop("vsup stop")
            return {"ok": True, "pid": os.getpid()}
        if cmd == "restart":
            restarted = self.supervisor.request_restart(request.get("role"), request.get("dp"),
                                                        request.get("replica"), bool(request.get("rolling")))
            return {"ok": bool(restarted), "units": restarted}
        return {"error": f"unknown command {cmd!r}"}

    def ps(self) -> dict:
        """The snapshot plus what psutil sees of each live process: CPU% since the last ps, RSS."""
        state = self.supervisor.snapshot()
        for p in state["processes"]:
            pid = p.get("pid")
            p["cpu_percent"] = p["rss_bytes"] = None
            if pid is None:
                continue
            try:
                proc = self.procs.get(pid) or self.procs.setdefault(pid, psutil.Process(pid))
                with proc.oneshot():
                    p["cpu_percent"] = proc.cpu_percent(None)
                    p["rss_bytes"] = proc.memory_info().rss
            except psutil.Error:
                pass
        return state

    def close(self) -> None:
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


def request(path: str, payload: dict, timeout: float = 5.0) -> dict:
    """Ask the supervisor; raises OSError when none listens there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall((json.dumps(payload) + "\n").encode())
        return json.loads(sock.makefile().readline())
