"""On a headless node: whether the head node still answers, so that a node whose head is gone gives up
(exit 1: under a LeaderWorkerSet the group is recreated) instead of waiting for it forever (vLLM #32136).

A thread connects to the head's HTTP port (--probe-port, else --port) every PERIOD_S (a TCP handshake:
the head's supervisor or API servers listen there while they live; a dead head refuses, a cut link times
out) and posts what it found to the loop; it writes no supervisor state. Never an engine port: an engine
core takes a connection that drops there for a remote worker's death. `head_lost` is the decision, pure.
A head that never answers (one that listens on 127.0.0.1, or on another --port) is never given up.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

PERIOD_S = 2.0
HEAD = "head"  # an inbox item: (HEAD, answered, when)


def head_lost(last_answer: float | None, now: float, timeout_s: float) -> bool:
    """Whether the head is given up: it answered once (a node may start before its head), and not for
    `timeout_s` since."""
    return last_answer is not None and now - last_answer > timeout_s


class HeadWatch(threading.Thread):
    def __init__(self, address: tuple[str, int], post: Callable[[tuple], None]):
        super().__init__(name="head-watch", daemon=True)
        self.address, self.post = address, post
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                socket.create_connection(self.address, timeout=PERIOD_S).close()
                answered = True
            except OSError:
                answered = False
            self.post((HEAD, answered, time.monotonic()))
            self.stopping.wait(PERIOD_S)

    def stop(self) -> None:
        self.stopping.set()
