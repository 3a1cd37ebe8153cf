"""Telling others: systemd through NOTIFY_SOCKET, and an engine core that its workers died."""

from __future__ import annotations

import os
import socket

from vsup import addresses
from vsup.rundir import RunDir


def sd_notify(state: str) -> bool:
    """Send `state` (READY=1, STOPPING=1) to systemd when NOTIFY_SOCKET is set; False otherwise."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # an abstract socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(state.encode(), address)
        except OSError:
            return False
    return True


class CoreNotifier:
    """PUSH sockets to the engine cores' control sockets, opened on first use.

    The core learns of a dead worker by itself too (a dead ring reader, a
    vanished pid); this just tells it at once, even while it is idle. The
    message is a plain msgpack map: vsup never imports the engine.
    """

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self.ctx = None
        self.socks = {}

    def connect(self, dp: int) -> None:
        """Reach core `dp` from now on (call when it starts: a message goes only where a connection is)."""
        import zmq

        if self.ctx is None:
            self.ctx = zmq.Context()
        if dp not in self.socks:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 16)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # never queued for a core that is gone: its replacement must
            # not take a stale "workers lost" for news and drop its healthy group
            sock.connect(addresses.core_control_socket(str(self.run_dir.path), dp))
            self.socks[dp] = sock

    def workers_lost(self, dp: int, reason: str) -> None:
        self._send(dp, {"type": "workers_lost", "reason": reason})

    def drain(self, dp: int) -> bool:
        """Ask core `dp` to finish what runs and start nothing new; False when it is not there to ask."""
        return self._send(dp, {"type": "drain"})

    def _send(self, dp: int, message: dict) -> bool:
        import msgspec
        import zmq

        self.connect(dp)
        try:
            self.socks[dp].send(msgspec.msgpack.encode(message), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False  # the core is not there (gone, or not started yet); it finds out by itself

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()
        if self.ctx is not None:
            self.ctx.term()
