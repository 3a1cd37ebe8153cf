"""`EngineClient`: the API server's asyncio ZeroMQ link to its engine cores.

The API server binds one ROUTER; each DP rank's engine core connects a
DEALER with identity `dp<rank>`. Requests go to the least-loaded rank that
can take them. When a core says Hello with a new instance id, it replaced
one that died: every request that ran there is resubmitted with the tokens
already received, so the client's stream goes on. A rank that says Failed is
routed around, and its requests move to another rank.

Its public API is ClientBase's (client_base.py), shared with InprocClient.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Sequence

import structlog
import zmq
import zmq.asyncio

from engine import cluster
from engine.api_server.client_base import ClientBase
from engine.api_server.dp_ranks import EngineUnavailable
from engine.api_server.request_stream import RequestStream
from engine.wire.protocol import (AbortRequests, AddRequest, Failed, FinishReason, Hello, Outputs, Ready, Refused,
                                  UtilityCall, UtilityResult, coordinator_out, encoder, from_core)
from engine.wire.sampling_params import SamplingParams

log = structlog.get_logger("api-server")

__all__ = ["EngineClient", "EngineUnavailable"]


class EngineClient(ClientBase):
    """Sends requests to the DP ranks' engine cores and routes their outputs back to streams."""

    def __init__(self, address: str, data_parallel_size: int = 1, *, heartbeat_timeout_s: float = 5.0,
                 coordinator_address: str | None = None, fingerprint: dict[str, str] | None = None):
        """`fingerprint`: what a core's Hello must carry to be served (engine/cluster.py); None admits any."""
        super().__init__(data_parallel_size, heartbeat_timeout_s)
        self.address = address
        self.coordinator_address = coordinator_address
        self.fingerprint = fingerprint
        self.refused: dict[str, str] = {}  # instance -> why: its messages are ignored
        self._guard: cluster.Guard | None = None
        self._watchdog: asyncio.Task | None = None
        self._load_reader: asyncio.Task | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None

    # lifecycle

    async def start(self) -> None:
        """Bind the ROUTER the engine cores connect to, and start reading it."""
        self._ctx = zmq.asyncio.Context()
        if cluster.is_remote(self.address):  # other nodes' cores connect: refuse who lacks the cluster secret
            self._guard = cluster.Guard(self._ctx).start()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished core raises instead of vanishing
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)   # a replacement core takes over its identity at once
        cluster.bind(sock, self.address)
        if self._guard is not None:
            self._guard.watch(sock, self.address)
        self._sock = sock
        self._receiver = asyncio.create_task(self._receive_loop(), name="engine-client-receive")
        self._watchdog = asyncio.create_task(self._watch_loop(), name="engine-client-watchdog")
        if self.coordinator_address:
            self._load_reader = asyncio.create_task(self._load_loop(), name="engine-client-load")
        log.info("waiting for engine cores", address=self.address, data_parallel_size=len(self.ranks.ranks))

    async def close(self) -> None:
        """Abort what is still running (the cores would otherwise finish it for nobody), then close."""
        for stream in list(self.requests.values()):
            self.abort(stream)
        for task in (self._receiver, self._load_reader, self._watchdog):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._sock is not None:
            if self._guard is not None:
                self._guard.unwatch(self._sock)
            self._sock.close()
            if self._guard is not None:
                self._guard.stop()
            self._ctx.term()
            self._sock = None

    # requests

    def add_request(self, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                    req_id: str | None = None) -> RequestStream:
        """Send a request to the least-loaded rank; raises EngineUnavailable when none can take it."""
        stream = RequestStream(req_id or uuid.uuid4().hex, prompt_token_ids, sampling, self.abort)
        self._submit(stream, self.ranks.choose())
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Finish the stream here at once and tell its core; late outputs for it are dropped."""
        if stream.is_finished:
            return
        self._forget(stream)
        if stream.dp_rank is not None:
            self._send(stream.dp_rank, AbortRequests([stream.wire_id]))
        stream.finish(FinishReason.ABORT)

    async def call_utility(self, method: str, *args, dp_rank: int | None = None, timeout_s: float = 5.0):
        """Call an engine-core method (`get_stats`, `ping`) on one rank and return its result."""
        dp_rank = self.ranks.choose() if dp_rank is None else dp_rank
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            if not self._send(dp_rank, UtilityCall(call_id, method, list(args))):
                raise EngineUnavailable(f"engine core dp{dp_rank} is not connected")
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    # sending

    def _submit(self, stream: RequestStream, dp_rank: int) -> None:
        """(Re)send a request: a resubmission carries the tokens received so far under a new wire id."""
        self._forget(stream)
        stream.num_submissions += 1
        stream.wire_id = stream.req_id if stream.num_submissions == 1 else f"{stream.req_id}~{stream.num_submissions}"
        self._track(stream, dp_rank)
        add = AddRequest(stream.wire_id, stream.prompt_token_ids, stream.sampling,
                         output_token_ids=list(stream.output_token_ids), arrival_time=stream.arrival_time)
        if not self._send(dp_rank, add):
            # its core is gone: try another rank; with none, it waits here for the replacement's Hello
            try:
                other = self.ranks.choose(exclude=frozenset({dp_rank}))
            except EngineUnavailable:
                return
            self._submit(stream, other)

    def _send(self, dp_rank: int, msg) -> bool:
        """Send without waiting; False when the rank's core is not connected."""
        if self._sock is None:
            return False
        try:
            sent = self._sock.send_multipart([f"dp{dp_rank}".encode(), encoder.encode(msg)])
        except zmq.ZMQError as e:
            sent = None
            error = e
        else:
            error = sent.exception() if sent.done() else None
            if not sent.done():  # the pipe is full: it goes once there is room
                sent.add_done_callback(lambda f: f.exception() and log.warning(
                    "send to engine core failed", dp_rank=dp_rank, error=str(f.exception())))
        if error is not None:
            log.warning("engine core unreachable", dp_rank=dp_rank, error=str(error), kind=type(msg).__name__)
            self.ranks.get(dp_rank).last_heard = None
            return False
        return True

    # receiving

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                log.warning("dropped malformed message", num_frames=len(frames))
                continue
            msg = from_core.decode_or_drop(frames[1], log, sender=frames[0].decode(errors="replace"))
            if msg is None:
                continue
            try:
                self._dispatch(msg)
            except Exception:  # one bad message must not stop every stream
                log.exception("failed to handle a message from an engine core", kind=type(msg).__name__)

    async def _load_loop(self) -> None:
        """Every rank's load from the coordinator (DP > 1): requests from all API servers count in routing."""
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        cluster.connect(sock, self.coordinator_address)
        try:
            while True:
                raw = await sock.recv()
                stats = coordinator_out.decode_or_drop(raw, log, sender="coordinator")
                if stats is None:
                    continue
                for dp_rank, (num_waiting, num_running) in stats.ranks.items():
                    if dp_rank in self.ranks.ranks:
                        self.ranks.set_external_load(dp_rank, num_waiting + num_running)
                for dp_rank, counters in stats.counters.items():
                    if dp_rank in self.ranks.ranks and len(counters) == 3:  # [steps, dummy steps, requests]
                        self.ranks.get(dp_rank).counters = tuple(counters)
        finally:
            sock.close()

    async def _watch_loop(self) -> None:
        """Move the requests of a rank not heard from within the heartbeat timeout (its node may be
        gone) to ranks that are up; the rank takes requests again once it is heard from."""
        while True:
            await asyncio.sleep(1.0)
            for dp_rank in list(self.ranks.ranks):
                held = [s for s in self.requests.values() if s.dp_rank == dp_rank]
                if not held or self.ranks.is_fresh(dp_rank):
                    continue
                try:
                    self.ranks.choose(exclude=frozenset({dp_rank}), fresh_only=True)
                except EngineUnavailable:
                    continue  # nowhere better: they wait for the rank (or its replacement)
                log.warning("engine core unresponsive; moving its requests", dp_rank=dp_rank,
                            num_requests=len(held), seconds_since_heard=self.ranks.seconds_since_heard(dp_rank))
                self._send(dp_rank, AbortRequests([s.wire_id for s in held]))  # should it still be there
                for stream in held:
                    self._submit(stream, self.ranks.choose(exclude=frozenset({dp_rank}), fresh_only=True))

    def _dispatch(self, msg) -> None:
        if getattr(msg, "instance", None) in self.refused:
            return
        if isinstance(msg, Outputs):
            self._deliver(msg.dp_rank, msg.outputs, msg.stats)
        elif isinstance(msg, Ready):
            if self.ranks.get(msg.dp_rank).instance != msg.instance:  # its Hello was before our time, or lost
                if self._refuse(msg.dp_rank, msg.instance, fingerprint_hash=msg.fingerprint_hash, pid=msg.pid,
                                node=msg.node):
                    return
                self._on_hello(msg.dp_rank, msg.instance, msg.pid, msg.node)
            if self.ranks.on_ready(msg.dp_rank, msg.max_model_len, draining=msg.draining):
                log.info("engine core ready", dp_rank=msg.dp_rank, max_model_len=msg.max_model_len,
                         num_blocks=msg.num_blocks)
        elif isinstance(msg, Hello):
            if not self._refuse(msg.dp_rank, msg.instance, msg.fingerprint, pid=msg.pid, node=msg.node):
                self._on_hello(msg.dp_rank, msg.instance, msg.pid, msg.node)
        elif isinstance(msg, Failed):
            self._on_failed(msg.dp_rank, msg.error)
        elif isinstance(msg, UtilityResult):
            future = self._calls.get(msg.call_id)
            if future is not None and not future.done():
                if msg.error is not None:
                    future.set_exception(RuntimeError(msg.error))
                else:
                    future.set_result(msg.result)

    def _refuse(self, dp_rank: int, instance: str, fingerprint: dict[str, str] | None = None,
                fingerprint_hash: str = "", **who) -> bool:
        """Refuse a core whose plan or model differs from ours (it exits, saying why); True if refused.

        Hello carries the whole fingerprint, so the refusal names what differs; a Ready from a core
        whose Hello this API server never saw (it restarted) carries only the hash."""
        if self.fingerprint is None:
            return False
        if fingerprint:
            why = cluster.differences(self.fingerprint, fingerprint)
            told = cluster.differences(self.fingerprint, fingerprint, here="on the head node", there="here")
        elif fingerprint_hash:
            ours = cluster.fingerprint_hash(self.fingerprint)
            why = "" if fingerprint_hash == ours else f"fingerprint {ours} here, {fingerprint_hash} on the peer"
            told = f"fingerprint {ours} on the head node, {fingerprint_hash} here"
        else:
            why = told = "it sent no fingerprint (another vsup version?)"
        if not why:
            return False
        self.refused[instance] = why
        log.error("refused engine core: its plan or model differs", dp_rank=dp_rank, **who, differences=why)
        self._send(dp_rank, Refused(f"the plan or model differs: {told}"))
        return True

    def _on_hello(self, dp_rank: int, instance: str, pid: int | None, node: str = "") -> None:
        replaced = self.ranks.on_hello(dp_rank, instance, pid, node)
        log.info("engine core says hello", dp_rank=dp_rank, pid=pid, replaced=replaced)
        if not replaced:
            return
        if self.on_restart is not None:
            self.on_restart("engine-core")
        held = [s for s in self.requests.values() if s.dp_rank == dp_rank]
        if held:
            log.warning("engine core was replaced; resubmitting its requests", dp_rank=dp_rank,
                        num_requests=len(held))
        for stream in held:
            try:
                self._submit(stream, self.ranks.choose())
            except EngineUnavailable as e:
                self._forget(stream)
                stream.finish(FinishReason.ERROR, str(e))

    def _on_failed(self, dp_rank: int, error: str) -> None:
        self.ranks.on_failed(dp_rank, error)
        held = [s for s in self.requests.values() if s.dp_rank == dp_rank]
        log.error("engine core failed; routing around it", dp_rank=dp_rank, error=error, num_requests=len(held))
        for stream in held:
            try:
                self._submit(stream, self.ranks.choose(exclude=frozenset({dp_rank})))
            except EngineUnavailable as e:
                self._forget(stream)
                stream.finish(FinishReason.ERROR, f"engine core dp{dp_rank} failed: {error}; {e}")
