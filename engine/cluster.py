"""Links that cross nodes: CurveZMQ keys from the cluster secret, refusals logged, the plan's fingerprint.

On one node every socket is ipc:// in the run dir (mode 0700). Across nodes
the same sockets are tcp://, and every tcp:// socket speaks CurveZMQ with
keys derived from the cluster secret (VSUP_CLUSTER_SECRET, never in argv):
the side that binds is the CURVE server, the side that connects a client. A
`Guard` in each process that binds tcp:// answers ZAP, admitting only the
secret's client key, and logs every peer it refuses, including those whose
handshake fails (no secret, or another one). Nobody without the secret can
send a message that is decoded, let alone obeyed.

`fingerprint()` is what must agree across nodes (model, parallel sizes,
dtype, ...): cores send it in Hello and API servers refuse a core whose
fingerprint differs, saying what differs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time
from dataclasses import dataclass

import structlog
import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = structlog.get_logger("cluster")
SECRET_ENV = "VSUP_CLUSTER_SECRET"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
# libzmq's protocol error codes of a failed handshake, in words
WHY = {0x11000001: "it encrypts with another --cluster-secret",
       0x11000002: "it does not encrypt (no --cluster-secret)"}
REPEAT_S = 10.0  # a refused peer retries every ~100 ms: one log line per kind and address per 10 s
# every tcp:// connection pings its peer this often, and drops a connection silent for HEARTBEAT_TIMEOUT_MS
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 1000, 5000
CONNECT_TIMEOUT_MS = 5000  # a connection attempt unanswered this long is begun afresh
BIND_RETRY_S = 5.0  # how long a bind waits for a port that one of our own closed sockets still holds


class NoSecret(RuntimeError):
    """A tcp:// socket without a cluster secret: it would take orders from anyone."""


@dataclass(frozen=True)
class Keys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def derive_keys(secret: str) -> Keys:
    """Both CURVE key pairs from the shared secret: every node derives the same ones."""
    def pair(label: bytes) -> tuple[bytes, bytes]:
        secret_key = z85.encode(hmac.new(secret.encode(), label, hashlib.sha256).digest())
        return zmq.curve_public(secret_key), secret_key

    server, client = pair(b"vsup curve server"), pair(b"vsup curve client")
    return Keys(*server, *client)


def is_remote(address: str) -> bool:
    return address.startswith("tcp://")


def _keys(address: str) -> Keys:
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise NoSecret(f"{address} is tcp:// but {SECRET_ENV} is not set: traffic between nodes must be "
                       f"authenticated (vsup serve --cluster-secret)")
    return derive_keys(secret)


def _heartbeat(sock: zmq.Socket) -> None:
    """A partition leaves TCP connections open and silent: ZeroMQ's pings drop such a connection after
    HEARTBEAT_TIMEOUT_MS, so that, once the link is back, traffic goes over a new one at once. On the
    old one it would wait for TCP's retransmissions, which back off while the link is down (up to
    two minutes; in a test, requests sent to a node 5 s after a 10 s cut had healed)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def bind(sock: zmq.Socket, address: str) -> None:
    """Bind; on tcp:// as the CURVE server of the cluster's keys, with heartbeats.

    A socket closed just before at the same address (a worker group formed again) frees its port only
    once ZeroMQ's I/O thread gets to it: EADDRINUSE is retried for BIND_RETRY_S, then raised."""
    if is_remote(address):
        _heartbeat(sock)
        keys = _keys(address)
        sock.curve_secretkey, sock.curve_publickey = keys.server_secret, keys.server_public
        sock.curve_server = True
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def connect(sock: zmq.Socket, address: str) -> None:
    """Connect; on tcp:// as a CURVE client that knows the cluster's server key, with heartbeats, and
    retrying a connection attempt that goes unanswered (its SYNs would back off as TCP's data does)."""
    if is_remote(address):
        _heartbeat(sock)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        keys = _keys(address)
        sock.curve_serverkey = keys.server_public
        sock.curve_secretkey, sock.curve_publickey = keys.client_secret, keys.client_public
    sock.connect(address)


class Guard:
    """Answers ZAP for one context and watches its tcp:// sockets' handshakes; logs every refusal.

    Start it before the guarded sockets bind (libzmq asks ZAP only when a
    handler is there); `unwatch` each watched socket before closing it, and
    stop the guard before the context terminates."""

    def __init__(self, ctx: zmq.Context):
        self.ctx = zmq.Context.shadow(ctx.underlying)  # inproc needs the same context; a sync view of it
        self.zap: zmq.Socket | None = None
        self.monitors: dict[zmq.Socket, str] = {}  # the guard thread's PAIR -> the address it reports
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.num_refused = 0
        self.last_logged: dict[tuple, tuple[float, int]] = {}  # (address, why) -> (when, refusals since)
        secret = os.environ.get(SECRET_ENV)
        self.client_key = z85.decode(derive_keys(secret).client_public) if secret else None

    def start(self) -> Guard:
        self.zap = self.ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        self.thread = threading.Thread(target=self._run, name="cluster-guard", daemon=True)
        self.thread.start()
        return self

    def watch(self, sock: zmq.Socket, address: str) -> None:
        """Log the handshakes that fail on `sock` (bound at tcp:// `address`): peers without our secret."""
        if not is_remote(address):
            return
        endpoint = f"inproc://vsup-guard-{id(sock):x}"
        sock.monitor(endpoint, HANDSHAKE_FAILED)
        pair = self.ctx.socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(endpoint)
        self.monitors[pair] = address

    def unwatch(self, sock: zmq.Socket) -> None:
        """Stop monitoring `sock`, from the thread that owns it, before closing it. The guard's own
        thread cannot: a libzmq socket is not thread-safe. Its PAIR is closed by `stop`. A socket that
        `watch` left alone (not tcp://) has no monitor to stop: nothing happens."""
        sock.disable_monitor()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=2)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.zap, zmq.POLLIN)
        seen: set[zmq.Socket] = set()
        try:
            while not self.stopping.is_set():
                for pair in set(self.monitors) - seen:  # watch() may add sockets after start()
                    poller.register(pair, zmq.POLLIN)
                    seen.add(pair)
                for sock, _ in poller.poll(200):
                    if sock is self.zap:
                        self._answer(sock.recv_multipart())
                    else:
                        self._handshake_failed(sock, sock.recv_multipart())
        finally:
            for sock in (self.zap, *self.monitors):
                sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        """One ZAP request: admit the cluster's client key only."""
        version, request_id, _domain, peer, _identity, mechanism, *credentials = frames
        ok = mechanism == b"CURVE" and self.client_key is not None and credentials[:1] == [self.client_key]
        if not ok:
            self._refused(peer.decode(errors="replace"), "its key is not this cluster's", mechanism=mechanism.decode())
        self.zap.send_multipart([version, request_id, b"200" if ok else b"400",
                                 b"OK" if ok else b"unknown key", b"", b""])

    def _handshake_failed(self, pair: zmq.Socket, frames: list[bytes]) -> None:
        value = parse_monitor_message(frames)["value"]
        self._refused(self.monitors[pair], WHY.get(value, f"its handshake failed (libzmq error {value:#x})"))

    def _refused(self, where: str, why: str, **extra) -> None:
        self.num_refused += 1
        now = time.monotonic()
        when, since = self.last_logged.get((where, why), (float("-inf"), 0))
        if now - when < REPEAT_S:
            self.last_logged[(where, why)] = (when, since + 1)
            return
        self.last_logged[(where, why)] = (now, 0)
        log.warning("refused a peer", at=where, reason=why, **extra,
                    **({"refused_since_last_line": since} if since else {}))


class HandshakeWatch:
    """A client's tcp:// handshakes: a server that keeps refusing them does not share our secret.

    `check()` (cheap; call it now and then) raises NoSecret after REFUSALS
    failures in a row with no success between them."""

    REFUSALS = 5

    def __init__(self, sock: zmq.Socket, address: str):
        self.address, self.sock = address, sock
        self.monitor = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.failures = 0

    def check(self) -> None:
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())["event"]
            self.failures = 0 if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else self.failures + 1
        if self.failures >= self.REFUSALS:
            raise NoSecret(f"{self.address} refused our handshake {self.failures} times in a row: is "
                           f"--cluster-secret (VSUP_CLUSTER_SECRET) the same on every node?")

    def close(self) -> None:
        if not self.sock.closed:  # first: an event for a closed monitor blocks ZeroMQ's I/O thread (worker_group.py)
            self.sock.disable_monitor()
        self.monitor.close(linger=0)


def fingerprint(model: str, *, tensor_parallel_size: int, pipeline_parallel_size: int, data_parallel_size: int,
                api_server_count: int, dtype: str, max_model_len: int | None, block_size: int,
                dp_lockstep: bool) -> dict[str, str]:
    """What every node of a deployment must agree on, as strings; the model by its config.json's content."""
    try:
        with open(os.path.join(model, "config.json"), "rb") as f:
            config_hash = hashlib.sha256(f.read()).hexdigest()[:12]
    except OSError:
        config_hash = "missing"
    from importlib.metadata import PackageNotFoundError, version

    try:
        vsup_version = version("vsup")
    except PackageNotFoundError:
        vsup_version = "unknown"
    return {"model": f"config.json {config_hash}", "model_dir": os.path.basename(os.path.normpath(model)),
            "tensor_parallel_size": str(tensor_parallel_size), "pipeline_parallel_size": str(pipeline_parallel_size),
            "data_parallel_size": str(data_parallel_size), "api_server_count": str(api_server_count),
            "dtype": dtype, "max_model_len": str(max_model_len or "auto"), "block_size": str(block_size),
            "dp_lockstep": str(dp_lockstep).lower(), "version": vsup_version}


def fingerprint_of(args, api_server_count: int) -> dict[str, str]:
    """fingerprint() of a role's parsed argv: the API server's and the engine core's spell these flags alike."""
    return fingerprint(
        args.model, tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size, api_server_count=api_server_count, dtype=args.dtype,
        max_model_len=args.max_model_len, block_size=args.block_size, dp_lockstep=args.dp_lockstep)


def fingerprint_hash(fp: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(_compared(fp), sort_keys=True).encode()).hexdigest()[:16]


def _compared(fp: dict[str, str]) -> dict[str, str]:
    """The model's directory name only helps a reader: nodes may keep the same model under other names."""
    return {k: v for k, v in fp.items() if k != "model_dir"}


def differences(ours: dict[str, str], theirs: dict[str, str], here: str = "here", there: str = "on the peer") -> str:
    """'' when the fingerprints agree, else what differs: 'tensor_parallel_size: 1 here, 2 on the peer; ...'."""
    mine, other = _compared(ours), _compared(theirs)
    return "; ".join(f"{k}: {_shown(ours, k)} {here}, {_shown(theirs, k)} {there}"
                     for k in sorted(set(mine) | set(other)) if mine.get(k) != other.get(k))


def _shown(fp: dict[str, str], key: str) -> str:
    if key == "model":
        return f"{fp.get('model_dir', '?')} ({fp.get('model', 'unset')})"
    return fp.get(key, "unset")
