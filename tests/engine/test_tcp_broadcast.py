"""The step ring's remote end: every message to every remote reader, in order; a lost core is PeerDied."""

from __future__ import annotations

import socket
import time

import pytest
import zmq

from engine.ring.shm_segment import PeerDied
from engine.ring.tcp_broadcast import TcpBroadcastReader, TcpBroadcastWriter


@pytest.fixture
def ctx(monkeypatch):
    monkeypatch.setenv("VSUP_CLUSTER_SECRET", "s")
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def free_address(ctx) -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def test_every_reader_gets_every_message_in_order_then_learns_the_writer_is_gone(ctx):
    address = free_address(ctx)
    writer = TcpBroadcastWriter(address, 2, ctx)
    readers = [TcpBroadcastReader(address, ctx) for _ in range(2)]
    writer.wait_for_readers(10)
    messages = [bytes([i % 256]) * (1 + i * 997 % 300_000) for i in range(200)]  # up to 300 kB each
    for m in messages:
        writer.enqueue(m)
    for r in readers:
        assert [r.dequeue(5) for _ in messages] == messages
    with pytest.raises(TimeoutError):
        readers[0].dequeue(0.1)
    writer.close()
    started = time.monotonic()
    for r in readers:
        with pytest.raises(PeerDied, match="is gone"):
            r.dequeue(10)
        r.close()
    assert time.monotonic() - started < 5


def test_the_writer_waits_for_its_readers_and_says_how_many_came(ctx):
    address = free_address(ctx)
    writer = TcpBroadcastWriter(address, 2, ctx)
    reader = TcpBroadcastReader(address, ctx)
    with pytest.raises(TimeoutError, match="1 of 2 remote workers subscribed"):
        writer.wait_for_readers(1.0)
    reader.close()
    writer.close()
