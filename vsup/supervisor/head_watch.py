"""On a headless node: whether the head node still answers, so that a node whose head is gone gives up
(exit 1: under a LeaderWorkerSet the group is recreated) instead of waiting for it forever (vLLM #32136).

A thread connects to the head's HTTP port (--probe-port, else --port) every PERIOD_S (a TCP handshake:
the head's supervisor or API servers listen there while they live; a dead head refuses, a cut link times
out) and posts what it found to the loop; it writes no supervisor state. Never an engine port: an engine
core takes a connection that drops there for a remote worker's death. `head_lost` is the decision, pure.
A head that never answers (one that listens on 127.0.0.1, or on another --port) is never given up.

With a stock vLLM across nodes the thread asks the head's /group instead, with the report of this node's
part that the loop left it (`report`), signed at each send, and posts the head's answer too (group.py);
`poke` asks at once.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Callable

from vsup.supervisor.group import Report

PERIOD_S = 2.0
HEAD = "head"  # an inbox item: (HEAD, answered, when, the head's /group answer: a dict, or None)


def head_lost(last_answer: float | None, now: float, timeout_s: float) -> bool:
    """Whether the head is given up: it answered once (a node may start before its head), and not for
    `timeout_s` since."""
    return last_answer is not None and now - last_answer > timeout_s


class HeadWatch(threading.Thread):
    def __init__(self, address: tuple[str, int], post: Callable[[tuple], None], secret: str | None = None):
        super().__init__(name="head-watch", daemon=True)
        self.address, self.post, self.secret = address, post, secret
        self.report: Report | None = None  # (set by the loop's thread)
        self.stopping, self.asked = threading.Event(), threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            report = self.report
            answered, reply = self.ask(report) if report is not None and self.secret else (self.knock(), None)
            self.post((HEAD, answered, time.monotonic(), reply))
            self.asked.wait(PERIOD_S)
            self.asked.clear()

    def knock(self) -> bool:
        try:
            socket.create_connection(self.address, timeout=PERIOD_S).close()
            return True
        except OSError:
            return False

    def ask(self, report: Report) -> tuple[bool, dict | None]:
        """(whether the head answered, its answer: {"gen", "up"}, or {"refused": status} when it refused)."""
        connection = http.client.HTTPConnection(*self.address, timeout=PERIOD_S)
        try:
            connection.request("GET", "/group?" + report.query(self.secret, time.time()))
            response = connection.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException):
            return False, None
        finally:
            connection.close()
        if response.status != 200:
            return True, {"refused": response.status}
        try:
            return True, json.loads(body)
        except ValueError:
            return True, {"refused": response.status}

    def poke(self) -> None:
        self.asked.set()

    def stop(self) -> None:
        self.stopping.set()
        self.asked.set()
