"""Malformed input on every socket of a running deployment: dropped, logged, and nothing dies.

For each socket, hypothesis draws 40 messages (tests/malformed.py: random
bytes, a real message cut short, msgpack of the wrong type, a real tag with
misshapen fields, a real message with a field nested past the recursion
limit; one to three frames each), all rejected by the receiver's own
decoder, then messages of 8 MiB. Afterwards no process died or
restarted, the receiver logged one "dropped malformed message" per message
it decoded (nobody else logged any), and the deployment serves the greedy
text it served before.

One node, -dp 2 -tp 2 --dp-lockstep, every socket ipc:// in the run dir:

    socket                   bound by             we connect  it decodes
    a0-engines.sock          api-server a0        DEALER      what cores say (ROUTER: 2 frames)
    coordinator-in.sock      coordinator          PUSH        loads and wave reports
    coordinator-out.sock     coordinator          XSUB        nothing (PUB: only subscriptions)
    coordinator-waves.sock   coordinator          XSUB        nothing
    dpN-workers.sock         engine-core dpN      DEALER      what workers say, while it steps
    dpN-control.sock         engine-core dpN      PUSH        the supervisor's WorkersLost, Shutdown
    dpN-wakeup.sock          engine-core dpN      XSUB        nothing (the step ring's wakeups)
    control.sock             supervisor           unix        JSON lines (ps, stop, restart)

A head node's tcp:// sockets (--dp-address), reached without the cluster
secret: plain ZeroMQ, CurveZMQ with another secret's keys, CurveZMQ with
the server's real public key and a client key of our own, and raw bytes on
the TCP connection. The head refuses and logs each ZeroMQ stranger, and
nothing any of them sends reaches a decoder (nor do they receive what a PUB
publishes); with the secret, one malformed message is decoded, dropped and
logged, so a stranger's message that got through would be counted.

Not reached from outside, since their one peer binds the address: what an
engine core reads from its API servers and the coordinator's waves, what a
worker reads from its core and its ring, what an API server reads from the
coordinator. Their decoders are fuzzed in tests/engine/test_wire.py.
"""

from __future__ import annotations

import json
import os
import socket
from collections import Counter
from contextlib import ExitStack, contextmanager

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from engine import cluster
from engine.wire.protocol import (CoreLoad, Hello, Outputs, Ready, Shutdown, WaveReport, WorkersLost, control,
                                  from_core, to_coordinator)
from engine.wire.worker_messages import CacheReady, WorkerReady, from_worker
from tests.e2e.served import Served, complete
from tests.e2e.test_multinode import free_port_block
from tests.malformed import DEPTH, FUZZ, OVERSIZED, control_requests, frames, oversized, rejects
from tests.polling import wait_for
from vsup import addresses

PROMPT, N = "what the fuzz left", 8
DROPPED = "dropped malformed message"
SECRET = "fuzz-test-secret"

READY = WorkerReady(name="worker dp0 pp0 tp0", pid=1, dp=0, pp=0, tp=0, device="cpu", num_blocks=8, block_size=16,
                    weight_bytes=1, kv_bytes_per_block=1, rss_bytes=1, load_seconds=0.0)
FROM_CORE = (from_core, [Hello(0, "i" * 32, 1), Ready(0, "i" * 32, 256, 8, 16), Outputs(0)])
TO_COORDINATOR = (to_coordinator, [CoreLoad(0, 0, 0, 0), WaveReport(0, "e" * 12, 0, 0, False)])
CONTROL = (control, [WorkersLost("x"), Shutdown()])
FROM_WORKER = (from_worker, [READY, CacheReady("worker dp0 pp0 tp0", 8, 64)])
# what a PUB gets: subscriptions (a first byte of 1 or 0) and anything else, which it drops
SUBSCRIPTIONS = st.lists(st.binary(max_size=64) | st.tuples(st.sampled_from([b"\x00", b"\x01"]), st.binary(
    max_size=63)).map(b"".join), min_size=1, max_size=3)


class Deployment:
    """A module's `vsup serve`, its greedy reference text, and what its log and ps say."""

    def __init__(self, served: Served, dp_address: str | None = None):
        self.served, self.dp_address = served, dp_address
        self.run_dir = os.path.join(served.home, served.name)
        self.client = served.client.with_options(timeout=30)
        self.reference = None

    def ready(self) -> Deployment:
        self.served.wait_serving()
        self.reference = complete(self.client, PROMPT, n=N, stream=False)
        assert self.reference
        return self

    def ipc(self, name: str) -> str:
        return f"ipc://{os.path.join(self.run_dir, name)}"

    def records(self) -> list[dict]:
        with open(os.path.join(self.run_dir, "logs", "vsup.jsonl"), encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    def drops(self) -> Counter:
        """How many malformed messages each process logged it dropped."""
        return Counter(r["name"] for r in self.records() if r.get("event") == DROPPED)

    def processes(self) -> dict:
        state = self.served.wait_serving(timeout=30)
        return {"supervisor": state["supervisor"]["pid"],
                **{p["name"]: (p["pid"], p["restarts"]) for p in state["processes"]}}

    @contextmanager
    def unharmed(self, drops: Counter):
        """Around a fuzz: afterwards every process is the one it was (no restart), the deployment serves
        the reference text, and the log has exactly `drops` (filled in by the body) new drop lines."""
        before, dropped = self.processes(), self.drops()
        yield drops
        assert self.served.proc.poll() is None, self.served.proc.stderr.read()
        assert complete(self.client, PROMPT, n=N, stream=False) == self.reference
        expected = dropped + drops
        try:  # the log lines come through the supervisor's pipes: wait for them
            wait_for(lambda: all(self.drops()[n] >= c for n, c in expected.items()), timeout=20)
        except TimeoutError:
            pass
        assert self.drops() == expected
        assert self.processes() == before


@pytest.fixture(scope="module")
def nodes(model, tmp_path_factory):
    """Both deployments, started at once: one node on ipc://, and a head node on tcp:// (--dp-address)."""
    common = ("-dp", "2", "--dp-lockstep")
    local = Served(tmp_path_factory.mktemp("fuzz-ipc"), model, *common, "-tp", "2", "--api-server-count", "1",
                   name="fuzz")
    dp_address = f"127.0.0.1:{free_port_block()}"
    head = Served(tmp_path_factory.mktemp("fuzz-tcp"), model, *common, "--api-server-count", "1",
                  "--dp-address", dp_address, name="head", env={cluster.SECRET_ENV: SECRET})
    try:
        yield Deployment(local), Deployment(head, dp_address)
    finally:
        for s in (local, head):
            s.kill()


@pytest.fixture(scope="module")
def local(nodes):
    return nodes[0].ready()


@pytest.fixture(scope="module")
def head(nodes):
    return nodes[1].ready()


@contextmanager
def peer(kind: int, address: str, **options):
    """A ZeroMQ socket of `kind` connected to `address`; closing it waits until what it sent is out."""
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 20_000)
    sock.setsockopt(zmq.SNDTIMEO, 20_000)  # a send that cannot go fails the test instead of hanging it
    for name, value in options.items():
        setattr(sock, name, value)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def fuzz(sock: zmq.Socket, messages: st.SearchStrategy[list[bytes]], flags: int = 0) -> list[list[bytes]]:
    """Send hypothesis's draws of `messages` on `sock`; returns what was sent (with zmq.NOBLOCK: what
    was queued)."""
    sent = []

    @FUZZ
    @given(messages)
    def send(message):
        try:
            sock.send_multipart(message, flags)
        except zmq.Again:
            assert flags & zmq.NOBLOCK
            return
        sent.append(message)

    send()
    return sent


def varied(sent: list[list[bytes]]) -> list[list[bytes]]:
    """`sent`, checked to hold what broke receivers before: a message of several frames, and a frame
    nested too deep."""
    assert any(len(m) > 1 for m in sent) and any(b"\x91" * DEPTH[0] in f for m in sent for f in m)
    return sent


def send_oversized(sock: zmq.Socket, decoder) -> int:
    big = oversized()
    assert all(rejects(decoder, raw) for raw in big)
    for raw in big:
        sock.send(raw)
    return len(big)


# one node, ipc://


def test_api_server_engine_socket(local):
    with local.unharmed(Counter()) as drops, peer(zmq.DEALER, local.ipc("a0-engines.sock")) as sock:
        sent = varied(fuzz(sock, frames(*FROM_CORE)))
        drops["api-server a0"] = len(sent) + send_oversized(sock, from_core)  # one line per message


def test_coordinator_input_socket(local):
    with local.unharmed(Counter()) as drops, peer(zmq.PUSH, local.ipc("coordinator-in.sock")) as sock:
        sent = varied(fuzz(sock, frames(*TO_COORDINATOR)))
        drops["coordinator"] = sum(map(len, sent)) + send_oversized(sock, to_coordinator)  # PULL: one per frame


@pytest.mark.parametrize("dp", [0, 1])
def test_engine_core_worker_socket(local, dp):
    """Read only while the core steps: the check's request (a step on both ranks, in lockstep) drains it."""
    with local.unharmed(Counter()) as drops, peer(zmq.DEALER, local.ipc(f"dp{dp}-workers.sock")) as sock:
        sent = varied(fuzz(sock, frames(*FROM_WORKER)))
        drops[f"engine-core dp{dp}"] = len(sent) + send_oversized(sock, from_worker)


def test_engine_core_control_socket(local):
    with local.unharmed(Counter()) as drops, peer(zmq.PUSH, local.ipc("dp1-control.sock")) as sock:
        sent = varied(fuzz(sock, frames(*CONTROL)))
        drops["engine-core dp1"] = sum(map(len, sent)) + send_oversized(sock, control)


@pytest.mark.parametrize("name", ["coordinator-out.sock", "coordinator-waves.sock", "dp0-wakeup.sock"])
def test_publisher_sockets(local, name):
    """A PUB takes subscriptions only: nothing is decoded, so nothing is logged; nothing may die either."""
    with local.unharmed(Counter()), peer(zmq.XSUB, local.ipc(name)) as sock:
        fuzz(sock, SUBSCRIPTIONS)
        sock.send(b"\x02" + bytes(OVERSIZED))  # no subscription (its first byte is 2): the PUB drops it


def test_supervisor_control_socket(local):
    path = addresses.control_socket(local.run_dir)

    def ask(data: bytes) -> dict | None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect(path)
            try:
                conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)
                return json.loads(conn.makefile().readline())
            except OSError:  # hung up on a request over the limit before it was all sent
                return None

    sent, answers = [], []
    with local.unharmed(Counter()) as drops:

        @FUZZ
        @given(control_requests())
        def send(data):
            sent.append(data)
            answers.append(ask(data))

        send()
        oversized_answer = ask(b"x" * OVERSIZED + b"\n")
        drops["supervisor"] = len(answers) + 1
    assert any(data.startswith(b"[" * DEPTH[0]) for data in sent)  # what killed the supervisor before
    assert all(a is not None and a["error"] for a in answers), answers
    assert oversized_answer is None or "longer than" in oversized_answer["error"]


# a head node's tcp:// sockets, without the cluster secret

# what it is in addresses.DP_PORTS: (the process that binds it, what we connect, what it decodes)
TCP = {"coordinator-in": ("coordinator", zmq.PUSH, TO_COORDINATOR),
       "coordinator-out": ("coordinator", zmq.SUB, None),
       "coordinator-waves": ("coordinator", zmq.SUB, None),
       "api-server a0": ("api-server a0", zmq.DEALER, FROM_CORE)}
NO_ENCRYPTION, ANOTHER_SECRET = cluster.WHY[0x11000002], cluster.WHY[0x11000001]
UNKNOWN_KEY = "its key is not this cluster's"
# raw bytes on the TCP connection: anything, or a ZeroMQ 3 greeting (CURVE or NULL) and then anything
GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00"
RAW = st.one_of(st.binary(min_size=1, max_size=256),
                st.tuples(st.sampled_from([b"CURVE", b"NULL"]), st.binary(max_size=256)).map(
                    lambda t: GREETING + t[0].ljust(20, b"\0") + bytes(32) + t[1]))


def curve(keys: cluster.Keys | None = None, server_public: bytes | None = None) -> dict:
    """Socket options of a CURVE client with `keys` (its own new pair if None) toward `server_public`."""
    public, secret = (keys.client_public, keys.client_secret) if keys else zmq.curve_keypair()
    return dict(curve_serverkey=server_public or keys.server_public, curve_publickey=public, curve_secretkey=secret)


def strangers() -> dict[str, dict]:
    """Peers without the secret, by the reason the head logs when it refuses them."""
    return {NO_ENCRYPTION: {},
            ANOTHER_SECRET: curve(cluster.derive_keys("not-" + SECRET)),
            UNKNOWN_KEY: curve(server_public=cluster.derive_keys(SECRET).server_public)}  # as if it leaked


def fuzz_raw(port: int) -> None:
    """Hypothesis's draws of RAW, each on a TCP connection of its own, then OVERSIZED random bytes."""

    @FUZZ
    @given(RAW)
    def send(data):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            try:
                conn.sendall(data)
            except OSError:  # hung up on mid-send
                pass

    send()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        try:
            conn.sendall(oversized()[0])
        except OSError:
            pass


@pytest.mark.parametrize("what", list(TCP))
def test_head_node_socket_without_the_secret(head, what):
    role, kind, target = TCP[what]
    port = addresses.split_host_port(head.dp_address)[1] + addresses.DP_PORTS[what]
    address = f"tcp://127.0.0.1:{port}"
    source = f"127.0.0.{10 + list(TCP).index(what)}"  # ZAP refusals are logged once per peer address and 10 s
    start = len(head.records())

    def refused() -> set[str]:
        return {r["reason"] for r in head.records()[start:] if r.get("event") == "refused a peer"
                and r["name"] == role and r["at"] in (address, source)}

    with head.unharmed(Counter()) as drops, ExitStack() as stack:
        peers = {why: stack.enter_context(peer(kind, f"tcp://{source}:0;127.0.0.1:{port}", linger=0, **options))
                 for why, options in strangers().items()}
        for sock in peers.values():
            if kind == zmq.SUB:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            else:
                fuzz(sock, frames(*target), zmq.NOBLOCK)  # queued if there is room: nothing leaves without a handshake
        fuzz_raw(port)
        wait_for(lambda: refused() >= set(peers), timeout=20, what=f"refusals at {address}: {refused()}")
        friend = curve(cluster.derive_keys(SECRET))  # one with the secret
        if what == "coordinator-out":  # the load, published every second, reaches it and none of the strangers
            with peer(zmq.SUB, address, **friend) as sub:
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                assert sub.poll(10_000)
                assert sub.recv()
            assert not [why for why, sock in peers.items() if sock.poll(0)]
        if target is not None:  # the same kind of message with the secret is decoded: dropped and logged
            with peer(kind, address, **friend) as sock:
                sock.send(b"\xc1")
            drops[role] = 1  # and no more: none of the strangers' messages got through
