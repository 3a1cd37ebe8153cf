"""The step ring's remote end: every message of the ring, over tcp://, for workers on other nodes.

A TP or PP group that spans nodes (`--nnodes`) reads each step two ways:
the workers on the engine core's node from the shared-memory ring, the
others from this XPUB socket, to which the core sends every message too
(CurveZMQ with the cluster secret, like all traffic between nodes). The
writer counts its readers' subscriptions before the first step, so none
misses one; no high-water mark, so none is dropped. A reader learns that
the core's node is gone from ZeroMQ's heartbeats: PeerDied, as from the ring.
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from engine import cluster
from engine.ring.shm_segment import PeerDied


class TcpBroadcastWriter:
    """The engine core's end: binds `address` and sends every message to all remote readers."""

    def __init__(self, address: str, num_readers: int, ctx: zmq.Context):
        self.num_readers = num_readers
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)        # never drop a step
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every reader's subscription reaches us
        try:
            cluster.bind(self.sock, address)  # tcp://: with ZeroMQ's heartbeats
        except zmq.ZMQError:
            self.sock.close(linger=0)
            raise
        self.subscribed = 0

    def wait_for_readers(self, timeout: float) -> None:
        """Return once every remote reader subscribed; TimeoutError naming how many did."""
        deadline = time.monotonic() + timeout
        while self.subscribed < self.num_readers:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(left * 1000):
                raise TimeoutError(f"{self.subscribed} of {self.num_readers} remote workers subscribed "
                                   f"to the step stream within {timeout:g} s")
            self.subscribed += self.sock.recv()[:1] == b"\x01"

    def enqueue(self, data: bytes) -> None:
        self.sock.send(data, copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class TcpBroadcastReader:
    """A remote worker's end: every message the core writes, in order."""

    def __init__(self, address: str, ctx: zmq.Context):
        self.address = address
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        cluster.connect(self.sock, address)

    def dequeue(self, timeout: float | None = None) -> bytes:
        """The next message; TimeoutError after `timeout` s, PeerDied once the core's node is gone."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic()) * 1000
            ready = dict(poller.poll(wait))
            if self.sock in ready:
                return self.sock.recv()
            if self.monitor in ready:
                parse_monitor_message(self.monitor.recv_multipart())
                raise PeerDied(f"the engine core at {self.address} is gone (connection lost)")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no step from {self.address} within {timeout} s")

    def close(self) -> None:
        self.sock.disable_monitor()  # first: an event for a closed monitor blocks ZeroMQ's I/O thread (worker_group.py)
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
