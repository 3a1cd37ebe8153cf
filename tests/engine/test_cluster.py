"""Traffic between nodes: only peers with the cluster secret get a message through; every refusal is logged."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import structlog
import zmq
from zmq.utils import z85

from engine import cluster
from tests.polling import wait_for


@pytest.fixture
def guarded(monkeypatch):
    """A ROUTER bound on loopback tcp:// as the head binds it, behind a Guard; yields (ctx, address, guard)."""
    monkeypatch.setenv(cluster.SECRET_ENV, "the-secret")
    ctx = zmq.Context()
    guard = cluster.Guard(ctx).start()
    server = ctx.socket(zmq.ROUTER)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    cluster.bind(server, address)
    guard.watch(server, address)
    clients = []

    def client(secret: str | None = "the-secret", keys: tuple[bytes, bytes] | None = None) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        clients.append(sock)
        if keys is not None:  # someone who learned the server's public key, with a key pair of their own
            sock.curve_serverkey = cluster.derive_keys("the-secret").server_public
            sock.curve_publickey, sock.curve_secretkey = keys
            sock.connect(address)
        elif secret is None:
            sock.connect(address)
        else:
            monkeypatch.setenv(cluster.SECRET_ENV, secret)
            cluster.connect(sock, address)
            monkeypatch.setenv(cluster.SECRET_ENV, "the-secret")
        return sock

    with structlog.testing.capture_logs() as logs:
        yield server, client, guard, logs
    for sock in (*clients, server):
        sock.close(linger=0)
    guard.stop()
    ctx.term()


def offer(stranger: zmq.Socket, data: bytes) -> None:
    """A stranger's send, where its socket takes it: a refused peer's connection may already be torn down (it
    tries again every ~100 ms), and a DEALER without one blocks on send. The guard sees its connecting."""
    try:
        stranger.send(data, zmq.NOBLOCK)
    except zmq.Again:
        pass


def received(server: zmq.Socket, timeout_ms: int = 1500) -> list[bytes]:
    out = []
    while server.poll(timeout_ms):
        out.append(server.recv_multipart()[-1])
        timeout_ms = 100
    return out


def test_only_the_secret_gets_through_and_strangers_are_logged(guarded):
    server, client, guard, logs = guarded
    offer(client("another-secret"), b"order from a stranger")
    offer(client(None), b"plain msgpack")
    offer(client(keys=zmq.curve_keypair()), b"knows the server key only")
    client().send(b"from the cluster")
    assert received(server) == [b"from the cluster"]
    reasons = {"it encrypts with another --cluster-secret", "it does not encrypt (no --cluster-secret)",
               "its key is not this cluster's"}
    wait_for(lambda: {e["reason"] for e in logs if e["event"] == "refused a peer"} == reasons, timeout=30,
             what=f"every stranger refused and logged: {reasons}")
    # a refused peer retries every ~100 ms: its refusals are counted, not each logged
    wait_for(lambda: guard.num_refused > len([e for e in logs if e["event"] == "refused a peer"]) == 3,
             timeout=30, what="the strangers' retries counted, and not logged again")


def test_an_unwatched_socket_reports_no_more_handshakes_and_the_zap_still_refuses(guarded):
    """What an owner does before closing a watched socket: its monitor is off, stopped on the owner's thread."""
    server, client, guard, logs = guarded
    guard.unwatch(server)
    stranger = client("another-secret")  # refused by its handshake, which only the monitor saw
    watch = cluster.HandshakeWatch(stranger, "tcp://head")
    offer(client(keys=zmq.curve_keypair()), b"knows the server key only")  # refused by the ZAP handler
    offer(stranger, b"order from a stranger")

    def refused_five_times() -> bool:
        try:
            watch.check()
        except cluster.NoSecret:
            return True
        return False

    try:  # the watch's monitor closed whatever happens, or the fixture's ctx.term() waits for it for good
        wait_for(refused_five_times, timeout=30, what="the stranger's handshake refused five times")
    finally:
        watch.close()
    wait_for(lambda: guard.num_refused, timeout=30, what="the ZAP handler refusing the unknown key")
    assert received(server, timeout_ms=100) == []
    assert {e["reason"] for e in logs if e["event"] == "refused a peer"} == {"its key is not this cluster's"}


def test_a_client_learns_that_the_server_refuses_its_handshake(guarded):
    server, client, guard, logs = guarded
    sock = client("another-secret")
    watch = cluster.HandshakeWatch(sock, "tcp://head")
    deadline = time.monotonic() + 10
    with pytest.raises(cluster.NoSecret, match="is --cluster-secret"):
        while time.monotonic() < deadline:
            watch.check()
            time.sleep(0.1)
    watch.close()
    good = client()
    ok = cluster.HandshakeWatch(good, "tcp://head")
    good.send(b"hi")
    assert received(server) == [b"hi"]
    ok.check()  # a success resets the count: no raise
    ok.close()


def test_a_silent_connection_is_dropped_and_a_new_one_made_when_the_peer_speaks_again(guarded):
    """A partition leaves a TCP connection open and silent, as a stopped process does: the heartbeats
    drop it, and the peer's messages then come over a new one, not after TCP's backed-off retries."""
    server, _client, _guard, _logs = guarded
    address = server.getsockopt_string(zmq.LAST_ENDPOINT)
    dropped = server.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    peer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, zmq; from engine import cluster; sock = zmq.Context().socket(zmq.DEALER); "
        "cluster.connect(sock, sys.argv[1])\n"
        "while True: sock.send(b'alive'); time.sleep(0.2)"), address], env=os.environ)
    try:
        assert received(server, timeout_ms=30_000)[:1] == [b"alive"]
        peer.send_signal(signal.SIGSTOP)
        assert dropped.poll(30_000), "the silent connection was never dropped"
        received(server, timeout_ms=100)  # what came before the stop
        peer.send_signal(signal.SIGCONT)
        assert received(server, timeout_ms=30_000)[:1] == [b"alive"]
    finally:
        peer.kill()
        peer.wait()
        dropped.close(linger=0)


def test_tcp_without_a_secret_is_refused_before_any_socket_opens(monkeypatch):
    monkeypatch.delenv(cluster.SECRET_ENV, raising=False)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    try:
        with pytest.raises(cluster.NoSecret, match="VSUP_CLUSTER_SECRET"):
            cluster.connect(sock, "tcp://127.0.0.1:1")
        cluster.connect(sock, "ipc:///nonexistent/x.sock")  # local sockets need none
    finally:
        sock.close(linger=0)
        ctx.term()


def test_keys_are_derived_alike_everywhere_and_differ_by_secret():
    a, b, c = cluster.derive_keys("s"), cluster.derive_keys("s"), cluster.derive_keys("t")
    assert a == b and a.server_public != c.server_public and a.client_public != a.server_public
    assert len(z85.decode(a.server_public)) == 32


def test_fingerprints_name_what_differs(tmp_path):
    (tmp_path / "m1").mkdir()
    (tmp_path / "m1" / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "m2").mkdir()
    (tmp_path / "m2" / "config.json").write_text('{"hidden_size": 128}')
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "config.json").write_text('{"hidden_size": 64}')
    sizes = dict(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=2, api_server_count=2,
                 dtype="auto", max_model_len=None, block_size=16, dp_lockstep=False)
    head = cluster.fingerprint(str(tmp_path / "m1"), **sizes)
    assert cluster.differences(head, cluster.fingerprint(str(tmp_path / "copy"), **sizes)) == ""  # same model
    assert cluster.fingerprint_hash(head) == cluster.fingerprint_hash(cluster.fingerprint(str(tmp_path / "copy"),
                                                                                          **sizes))
    other = cluster.fingerprint(str(tmp_path / "m2"), **{**sizes, "tensor_parallel_size": 2})
    why = cluster.differences(head, other)
    assert why.startswith("model: m1 (config.json ") and "here, m2 (config.json " in why
    assert "tensor_parallel_size: 1 here, 2 on the peer" in why
    assert cluster.fingerprint_hash(head) != cluster.fingerprint_hash(other)
