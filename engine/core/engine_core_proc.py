"""`EngineCoreProc`: an EngineCore as its own process, the one `vsup serve` starts.

    python -m engine.core --model DIR --dp-rank 0 --api-server-address ipc://RUN/a0-engines.sock \
        --worker-address ipc://RUN/dp0-workers.sock --control-address ipc://RUN/dp0-control.sock ...

Startup: say Hello to every API server, wait for the worker group's READY,
size the KV cache, say Ready. Then the busy loop: take requests, step while
there is work, send outputs; block on the sockets when idle (a Ready
heartbeat every second tells API servers the core lives). When the worker
group dies the core requeues its requests and waits for the new group.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import msgspec
import structlog
import zmq

from engine import cluster
from engine.args import add_parallel_sizes, add_structured_output_limits, role_parser
from engine.core.engine_core import EngineCore
from engine.core.setup import build_engine_core, start_worker_group
from engine.core.wave_follower import WaveFollower
from engine.executor.worker_group import WorkerGroup, WorkerGroupFailed
from engine.load import LoadMeter, report_to_supervisor
from engine.model.config import ModelConfig
from engine.process import freeze_heap
from engine.wire.decoder import Decoder
from engine.wire.protocol import (AbortRequests, AddRequest, CoreLoad, Drain, Failed, Hello, Outputs, Ready,
                                  Refused, RequestUpdate, Shutdown, UtilityCall, UtilityResult, WorkersLost,
                                  control, encoder, from_waves, to_core)

log = structlog.get_logger("engine-core")
HEARTBEAT_S = 1.0
LOAD_COUNTERS_S = 0.1  # step counters reach the coordinator this often while they run
REPORTED_REQUESTS = 256  # of the requests it holds, at most this many named in its load report (for incidents)
GAUGES_S = 0.5         # running, waiting and KV use for `vsup ps` (engine/load.py)


class CoreFailed(RuntimeError):
    """The core cannot serve: its workers never came (back)."""


class CoreRefused(CoreFailed):
    """An API server will not serve with this core (its plan or model differs): it must not say Failed
    for a rank that may be someone else's."""


class EngineCoreProc:
    """The sockets and the loop around one EngineCore."""

    def __init__(self, args):
        self.args = args
        self.dp_rank = args.dp_rank
        self.instance = uuid.uuid4().hex
        self.ctx = zmq.Context()
        self.clients = []
        for address in args.api_server_address:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"dp{self.dp_rank}".encode())
            sock.setsockopt(zmq.LINGER, 1000)
            cluster.connect(sock, address)
            self.clients.append(sock)
        self.client_address = dict(zip(self.clients, args.api_server_address))
        self.handshakes = [cluster.HandshakeWatch(sock, address)
                           for sock, address in zip(self.clients, args.api_server_address) if cluster.is_remote(address)]
        self.coordinator = None
        if args.coordinator_address:
            self.coordinator = self.ctx.socket(zmq.PUSH)
            self.coordinator.setsockopt(zmq.LINGER, 0)
            self.coordinator.setsockopt(zmq.SNDHWM, 100)
            cluster.connect(self.coordinator, args.coordinator_address)
        # --dp-lockstep (DP > 1): the coordinator's step waves
        self.waves = None
        if args.dp_lockstep and args.wave_address and self.coordinator is not None:
            self.waves = self.ctx.socket(zmq.SUB)
            self.waves.setsockopt(zmq.LINGER, 0)
            self.waves.setsockopt(zmq.SUBSCRIBE, b"")
            cluster.connect(self.waves, args.wave_address)
        self.follower = WaveFollower(self.dp_rank)
        self.meter = LoadMeter()
        self.said_drained = False
        self.gauges_at = 0.0
        self.kv_stalls_counted = 0
        self.last_counters: tuple[int, int, int] | None = None
        self.last_load_at = 0.0
        self.last_load: tuple[int, int] | None = None
        self.control = self.ctx.socket(zmq.PULL)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.bind(args.control_address)
        self.owner: dict[str, zmq.Socket] = {}  # request id -> the API server that sent it
        self.model_config = ModelConfig.from_pretrained(args.model)
        self.core: EngineCore | None = None
        self.group: WorkerGroup | None = None
        self.lost_at: float | None = None
        self.last_heartbeat = 0.0

    # lifecycle

    def run(self) -> None:
        fingerprint = cluster.fingerprint_of(self.args, len(self.args.api_server_address))
        self.fingerprint_hash = cluster.fingerprint_hash(fingerprint)
        self.say(Hello(dp_rank=self.dp_rank, instance=self.instance, pid=os.getpid(),
                       fingerprint=fingerprint, node=socket.gethostname()))
        self.group = self.start_group(self.args.startup_timeout)
        try:
            self.core = build_engine_core(self.args, self.group, self.model_config)
        except ValueError as e:
            raise CoreFailed(str(e)) from None
        freeze_heap()
        self.say_ready()
        log.info("ready", num_blocks=self.core.config.num_blocks, max_model_len=self.core.config.max_model_len)
        report_to_supervisor(self.meter)
        self.loop()

    def start_group(self, timeout_s: float) -> WorkerGroup:
        a = self.args
        return start_worker_group(a.worker_address, a.tensor_parallel_size * a.pipeline_parallel_size, timeout_s,
                                  ring_prefix=a.ring_prefix, wakeup_address=a.wakeup_address,
                                  remote_address=a.ring_remote_address, ctx=self.ctx, interrupt=self.control,
                                  on_interrupt=self.on_control, on_wait=self.heartbeat)

    def loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self.control, *self.clients, *([self.waves] if self.waves is not None else [])):
            poller.register(sock, zmq.POLLIN)
        while True:
            if self.waves is not None:  # lockstep: step only on the coordinator's go
                busy = self.core.executor is not None and self.follower.go is not None
            else:
                busy = self.core.executor is not None and self.core.has_work()
            for sock, _ in poller.poll(0 if busy else HEARTBEAT_S * 1000):
                if sock is self.waves:
                    self.drain_waves()
                elif sock is not self.control:
                    self.drain_client(sock)
                else:
                    try:
                        self.on_control()
                    except WorkerGroupFailed as e:
                        self.lose_workers(str(e))
            if self.core.executor is not None and not busy:
                try:
                    self.group.check()  # a worker lost while idle: found now, not at the next request's step
                except WorkerGroupFailed as e:
                    self.lose_workers(str(e))
            if self.core.executor is None:
                self.regain_workers()
            elif self.waves is not None:
                self.lockstep()
            elif self.core.has_work():
                try:
                    with self.meter.busy("step"):
                        updates = self.core.step()
                    self.publish(updates)
                except WorkerGroupFailed as e:
                    self.lose_workers(str(e))
            self.measure()
            if self.core.draining:
                self.say_drained()
            self.heartbeat()

    def heartbeat(self) -> None:
        """Load to the coordinator when it changed, and Ready every HEARTBEAT_S: also while the core
        waits for a new worker group, which can take longer than the API servers' heartbeat timeout
        (they would move its requests away, to a rank perhaps worse off)."""
        if self.core is None:  # starting: not ready yet
            return
        due = time.monotonic() - self.last_heartbeat >= HEARTBEAT_S
        self.report_load(force=due)
        if due:
            self.say_ready()

    # --dp-lockstep: the waves (engine/coordinator/waves.py)

    def lockstep(self) -> None:
        """Run the step the coordinator said to run, a dummy one if we have no work, and report it;
        with work and no go, ask for a wave."""
        go = self.follower.take_go()
        if go is not None:
            before = self.core.num_steps
            try:
                with self.meter.busy("step"):
                    updates = self.core.step() if self.core.has_work() else []
                    if self.core.num_steps == before and self.core.executor is not None:
                        self.core.dummy_step()  # nothing of ours ran: step anyway, with the others
                self.publish(updates)
            except WorkerGroupFailed as e:
                self.lose_workers(str(e))
                return
            self.follower.stepped(go)
            self.report_wave()
        elif self.follower.wants_report(self.core.has_work()):
            self.report_wave()

    def report_wave(self) -> None:
        """Tell the coordinator the step we last ran and whether we have work now."""
        try:
            self.coordinator.send(encoder.encode(self.follower.report(self.core.has_work())), zmq.NOBLOCK)
        except zmq.Again:
            pass  # no coordinator right now: asked again after WAVE_RESYNC_S

    def drain_waves(self) -> None:
        for msg in pending(self.waves, from_waves, "coordinator waves"):
            if self.follower.on_wave(msg):
                self.report_wave()

    def say_drained(self) -> None:
        """Once a drain has finished what ran: the supervisor waits for this event to restart."""
        if not self.said_drained and self.core.is_drained():
            log.info("drained", num_waiting=self.core.stats().num_waiting)
            self.said_drained = True

    def measure(self) -> None:
        """The gauges `vsup ps` shows (engine/load.py), at most every GAUGES_S, and the steps that
        waited for KV blocks (a rate: a snapshot of the usage alone misses a cache that churns)."""
        now = time.monotonic()
        if now - self.gauges_at >= GAUGES_S:
            stats = self.core.stats()
            scheduler = self.core.scheduler
            held = [*scheduler.running, *scheduler.waiting][:REPORTED_REQUESTS]  # (ids and counts: never text)
            self.meter.set(num_running=stats.num_running, num_waiting=stats.num_waiting,
                           kv_cache_usage=round(stats.kv_cache_usage, 4), steps=self.core.num_steps,
                           requests=[[r.req_id, len(r.token_ids) - r.num_prompt_tokens] for r in held])
            stalls = self.core.scheduler.num_kv_stalls
            self.meter.count("kv_stalls", stalls - self.kv_stalls_counted)
            self.kv_stalls_counted = stalls
            self.gauges_at = now

    def report_load(self, force: bool = False) -> None:
        """Tell the coordinator (DP > 1) our queue lengths when they change, and on every heartbeat;
        our step and request counters with them, at most every 100 ms while they run, at once when idle."""
        if self.coordinator is None:
            return
        stats = self.core.stats()
        load = (stats.num_waiting, stats.num_running)
        counters = (self.core.num_steps, self.core.num_dummy_steps, self.core.num_requests)
        now = time.monotonic()
        idle = not self.core.has_work() and not self.follower.in_wave
        if force or load != self.last_load or (counters != self.last_counters and (
                idle or now - self.last_load_at >= LOAD_COUNTERS_S)):
            self.last_load, self.last_counters, self.last_load_at = load, counters, now
            try:
                self.coordinator.send(encoder.encode(CoreLoad(self.dp_rank, *load, *counters)), zmq.NOBLOCK)
            except zmq.Again:
                pass  # no coordinator right now (it restarts alone); the next report goes through

    def close(self, shutdown_workers: bool = True) -> None:
        """Tell the workers to exit (on a stop), or leave them to the supervisor (on a failure: the
        core's exit code, not its workers' clean exits, must be what the supervisor sees first)."""
        if self.group is not None:
            self.group.close(shutdown_workers=shutdown_workers, tell_readers=shutdown_workers)
        for watch in self.handshakes:
            watch.close()
        for sock in (*self.clients, self.control, *([self.coordinator] if self.coordinator else []),
                     *([self.waves] if self.waves is not None else [])):
            sock.close()
        self.ctx.destroy(linger=0)  # and any socket a failure left open, which would hang term() for good

    # messages

    def on_control(self) -> None:
        """Handle the supervisor's messages; WorkersLost abandons the step being waited on."""
        for msg in pending(self.control, control, "control"):
            if isinstance(msg, Shutdown):
                log.info("stopping")
                raise SystemExit(0)
            if isinstance(msg, Drain) and self.core is not None:
                log.info("draining: the running requests finish, the waiting ones wait for the restart",
                         num_running=self.core.stats().num_running, num_waiting=self.core.stats().num_waiting)
                self.core.drain()
                self.said_drained = False
                self.say_ready()  # the API servers route new requests to the other ranks from now
            if isinstance(msg, WorkersLost) and self.core is not None and self.core.executor is not None:
                raise WorkerGroupFailed(f"the supervisor says: {msg.reason or 'workers lost'}")

    def drain_client(self, sock: zmq.Socket) -> None:
        for msg in pending(sock, to_core, self.client_address[sock]):
            if isinstance(msg, AddRequest):
                self.owner[msg.req_id] = sock
                refused = self.core.add_request(msg)
                if refused is not None:
                    self.publish([refused])
            elif isinstance(msg, AbortRequests):
                self.publish(self.core.abort_requests(msg.req_ids))
            elif isinstance(msg, UtilityCall):
                sock.send(encoder.encode(self.utility(msg)))
            elif isinstance(msg, Refused):
                raise CoreRefused(f"refused by the API server at {self.client_address[sock]}: {msg.reason}")

    def utility(self, call: UtilityCall) -> UtilityResult:
        if call.method == "get_stats":
            return UtilityResult(call.call_id, {
                **msgspec.to_builtins(self.core.stats()), "num_steps": self.core.num_steps,
                "num_dummy_steps": self.core.num_dummy_steps, "num_requests": self.core.num_requests})
        if call.method == "ping":
            return UtilityResult(call.call_id, "pong")
        return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")

    def publish(self, updates: list[RequestUpdate]) -> None:
        """Send each API server the updates of its own requests, with the core's load."""
        by_client: dict[zmq.Socket, list[RequestUpdate]] = {}
        for update in updates:
            sock = self.owner.get(update.req_id)
            if sock is None:
                continue
            by_client.setdefault(sock, []).append(update)
            if update.finish_reason is not None:
                del self.owner[update.req_id]
        stats = self.core.stats()
        for sock, batch in by_client.items():
            sock.send(encoder.encode(Outputs(self.dp_rank, batch, stats, self.core.num_steps)))

    def say(self, msg) -> None:
        payload = encoder.encode(msg)
        for sock in self.clients:
            sock.send(payload)

    def say_ready(self) -> None:
        """Ready, also the heartbeat (every second); a head that keeps refusing our handshake fails us."""
        for watch in self.handshakes:
            try:
                watch.check()
            except cluster.NoSecret as e:
                raise CoreRefused(str(e)) from None
        self.say(Ready(dp_rank=self.dp_rank, instance=self.instance, max_model_len=self.core.config.max_model_len,
                       num_blocks=self.core.config.num_blocks, block_size=self.core.config.block_size,
                       fingerprint_hash=self.fingerprint_hash, draining=self.core.draining, pid=os.getpid(),
                       node=socket.gethostname()))
        self.last_heartbeat = time.monotonic()

    # losing and regaining the worker group

    def lose_workers(self, reason: str) -> None:
        log.warning("worker group lost; requeueing requests for recompute", reason=reason,
                    num_running=self.core.stats().num_running)
        self.publish(self.core.lose_workers())
        self.group.close(shutdown_workers=False)
        self.group = None
        self.lost_at = time.monotonic()

    def regain_workers(self) -> None:
        """Wait for the new group, forming it again (a new generation) while one fails to form; past
        --worker-timeout the core fails."""
        while self.group is None:
            left = self.args.worker_timeout - (time.monotonic() - self.lost_at)
            try:
                self.group = self.start_group(max(left, 0.0))
            except WorkerGroupFailed as e:
                if time.monotonic() - self.lost_at >= self.args.worker_timeout:
                    raise CoreFailed(f"the worker group did not come back within {self.args.worker_timeout:g} s "
                                     f"({e})") from e
                log.warning("the new worker group failed to form; forming another", reason=str(e))
        self.publish(self.core.regain_workers(self.group))
        log.info("worker group back; recomputing", seconds=round(time.monotonic() - self.lost_at, 2),
                 num_blocks=self.group.num_blocks)
        self.lost_at = None
        self.say_ready()  # no longer draining, if a drain brought this on


def parse_args(argv: list[str] | None = None):
    p = role_parser("engine.core", "One engine core of a vsup tree.")
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--dp-rank", type=int, default=0)
    add_parallel_sizes(p)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    add_structured_output_limits(p)
    p.add_argument("--api-server-address", action="append", default=[], help="an API server's engine socket")
    p.add_argument("--worker-address", required=True, help="where this core's workers connect")
    p.add_argument("--control-address", required=True, help="where the supervisor sends WorkersLost and Shutdown")
    p.add_argument("--ring-prefix", required=True, help="/dev/shm name prefix of the step ring, unique per deployment")
    p.add_argument("--wakeup-address", required=True, help="the ring's wakeup socket")
    p.add_argument("--ring-remote-address", default=None,
                   help="a group spanning nodes: where its workers on other nodes read the steps (tcp://)")
    p.add_argument("--coordinator-address", default=None, help="where to push our load (DP > 1)")
    p.add_argument("--wave-address", default=None, help="where the coordinator publishes step waves (DP > 1)")
    p.add_argument("--dp-lockstep", action="store_true",
                   help="step with every other DP rank while any has work (dummy steps when idle)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--worker-timeout", type=float, default=120.0,
                   help="how long a lost worker group may take to come back before the core fails")
    args, _unknown = p.parse_known_args(argv)  # flags meant for other roles pass through untouched
    return args


def pending(sock: zmq.Socket, decoder: Decoder, sender: str):
    """Every message waiting on `sock`, decoded; a malformed one is logged and dropped."""
    while True:
        try:
            raw = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        msg = decoder.decode_or_drop(raw, log, sender=sender)
        if msg is not None:
            yield msg


def main(argv: list[str] | None = None) -> int:
    from engine.log import configure
    from engine.process import become, exit_on_sigterm, stopping

    args = parse_args(argv)
    become(f"engine-core dp{args.dp_rank}")
    configure("engine-core", dp=args.dp_rank)
    exit_on_sigterm()  # unwinds through close(): workers are told, sockets closed
    proc = EngineCoreProc(args)
    failed = True
    try:
        proc.run()
        failed = False
        return 0
    except (CoreFailed, WorkerGroupFailed) as e:
        log.error("engine core failed", error=str(e))
        if not isinstance(e, CoreRefused):
            proc.say(Failed(dp_rank=args.dp_rank, error=str(e)))
        return 1
    except SystemExit:
        failed = False
        raise
    finally:
        stopping()
        proc.close(shutdown_workers=not failed)
