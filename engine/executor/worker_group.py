"""The engine core's end of its workers: a ROUTER socket and a shared-memory ring.

Someone else starts the worker processes (the supervisor, or a test); the
group binds the address they connect to, tells each the epoch it joins
(engine/wire/worker_messages.py), waits for every READY, sizes the KV cache to
the smallest budget, then writes each step once into the ring that every
rank reads, and takes the sampled tokens from the sampling rank. A group
is one generation: a core that loses it forms a new one, with a new epoch.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import psutil
import structlog
import zmq

from engine import cluster
from engine.ring.shm_broadcast import PeerDied, RingClosed, ShmBroadcastWriter
from engine.ring.tcp_broadcast import TcpBroadcastWriter
from engine.wire.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.wire.worker_messages import (CacheReady, GroupEpoch, InitializeCache, JoinGroup, Shutdown, WorkerFailed,
                                         WorkerReady, encoder, from_worker)

log = structlog.get_logger("engine-core")
CHECK_S = 0.5  # while waiting, look this often whether every worker still lives
SEND_TIMEOUT_MS = 1000


class WorkerGroupFailed(RuntimeError):
    """A worker reported a failure, died, or the group did not answer in time."""


class WorkerGroup:
    """Talks to the TP x PP workers of one engine core."""

    def __init__(self, address: str, world_size: int, *, ring_prefix: str, wakeup_address: str,
                 remote_address: str | None = None, ctx: zmq.Context | None = None,
                 interrupt: zmq.Socket | None = None, on_interrupt: Callable[[], None] | None = None):
        """`on_interrupt` runs whenever `interrupt` is readable while the group waits;
        it may raise (WorkerGroupFailed, say) to abandon the wait. `remote_address`: where
        workers on other nodes (a group spanning nodes) read the steps."""
        self.world_size = world_size
        self.interrupt, self.on_interrupt = interrupt, on_interrupt
        self.ring_prefix, self.wakeup_address = ring_prefix, wakeup_address
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker raises, not vanishes
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)  # ... and one to a full pipe never blocks the core for good
        # a worker restarted under the same name may connect before its old connection is found dead (a node
        # lost: heartbeats, 5 s); the new connection takes the name over instead of being ignored until then
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            cluster.bind(self.sock, address)  # tcp:// (a group spanning nodes): CurveZMQ
        except zmq.ZMQError as e:  # the core forms the group again, or fails past --worker-timeout
            self.sock.close(linger=0)
            raise WorkerGroupFailed(f"cannot bind the workers' socket {address}: {e}") from e
        self.address, self.remote_address = address, remote_address
        self.epoch = secrets.token_hex(8)
        self.workers: dict[bytes, WorkerReady] = {}
        self.ring: ShmBroadcastWriter | None = None
        self.remote: TcpBroadcastWriter | None = None
        self.monitor: zmq.Socket | None = None  # a group spanning nodes: its workers' connections dropping
        self.checked_at = 0.0  # when check() last looked at the local workers' pids

    def _recv(self, timeout_s: float | None, on_wait: Callable[[], None] | None = None) -> tuple[bytes, object]:
        """The next message of a worker; `on_wait` runs every CHECK_S while none comes."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.interrupt is not None:
            poller.register(self.interrupt, zmq.POLLIN)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = CHECK_S if deadline is None else min(CHECK_S, max(0.0, deadline - time.monotonic()))
            ready = dict(poller.poll(wait * 1000))
            if self.interrupt is not None and self.interrupt in ready:
                self.on_interrupt()
            if self.sock not in ready:
                if deadline is not None and time.monotonic() >= deadline:
                    raise WorkerGroupFailed(f"no answer from the workers within {timeout_s} s")
                self._check_alive()
                self._check_connections()
                if on_wait is not None:
                    on_wait()
                continue
            frames = self.sock.recv_multipart()
            if len(frames) != 2:  # a worker sends one frame; the ROUTER puts the sender's identity first
                log.warning("dropped malformed message", sender=frames[0].decode(errors="replace"),
                            num_frames=len(frames))
                continue
            identity, raw = frames
            msg = from_worker.decode_or_drop(raw, log, sender=identity.decode(errors="replace"))
            if msg is None:
                continue
            if isinstance(msg, JoinGroup):
                self._replaced(identity, msg.name, msg.pid)
                self._send(identity, GroupEpoch(self.epoch))
                continue
            if getattr(msg, "epoch", self.epoch) != self.epoch:  # READY, CacheReady, WorkerFailed
                log.info("dropped a message of an earlier generation of the group",
                         sender=identity.decode(errors="replace"), message=type(msg).__name__)
                if isinstance(msg, WorkerReady):
                    self._send(identity, Shutdown())  # it waits for a cache that will never come
                continue
            if isinstance(msg, WorkerFailed):
                if not msg.joined and identity not in self.workers:
                    log.warning("worker failed before it joined its group; waiting for its restart",
                                worker=msg.name, error=msg.error)
                    continue
                raise WorkerGroupFailed(f"{msg.name}: {msg.error}")
            if isinstance(msg, WorkerReady):
                self._replaced(identity, msg.name, msg.pid)
            return identity, msg

    def _replaced(self, identity: bytes, name: str, pid: int) -> None:
        known = self.workers.get(identity)
        if known is not None and pid != known.pid:
            raise WorkerGroupFailed(f"{name} was replaced (pid {known.pid}, now {pid}); its node restarted it")

    def _send(self, identity: bytes, msg) -> None:
        """Best effort: a worker that does not get it says READY again (every 2 s), and is answered again."""
        try:
            self.sock.send_multipart([identity, msg if isinstance(msg, bytes) else encoder.encode(msg)])
        except zmq.ZMQError:  # gone meanwhile (ROUTER_MANDATORY), or its pipe is full (SNDTIMEO): not now
            pass

    def _check_alive(self) -> None:
        """A worker that died without a word (kill -9) is found by its pid, not by waiting forever.
        (One on another node: by its group's collectives failing on this node, or its node
        restarting it, whose new READY says so.)"""
        for ready in self.workers.values():
            if ready.node_rank:
                continue
            try:
                dead = psutil.Process(ready.pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                dead = True
            if dead:
                raise WorkerGroupFailed(f"{ready.name} (pid {ready.pid}) died")

    def check(self) -> None:
        """For an idle core: WorkerGroupFailed if a remote worker's connection dropped or, looked at every
        CHECK_S at most (32 us a worker), a worker of this node died: what its next step would find."""
        self._check_connections()
        now = time.monotonic()
        if now - self.checked_at >= CHECK_S:
            self.checked_at = now
            self._check_alive()

    def _check_connections(self) -> None:
        """A group spanning nodes: a worker whose connection dropped (its process or node is gone)
        fails the group at once, even while no step runs."""
        if self.monitor is not None and self.monitor.poll(0):
            self.monitor.recv_multipart()
            raise WorkerGroupFailed("a worker's connection dropped (its process or its node is gone)")

    def wait_for_ready(self, timeout_s: float = 300.0, on_wait: Callable[[], None] | None = None) -> list[WorkerReady]:
        """Block until all ranks said READY, running `on_wait` every CHECK_S meanwhile; raises
        WorkerGroupFailed on a failure or timeout."""
        deadline = time.monotonic() + timeout_s
        while len(self.workers) < self.world_size:
            identity, msg = self._recv(max(0.0, deadline - time.monotonic()), on_wait)
            if isinstance(msg, WorkerReady):
                self.workers[identity] = msg
                log.info("worker ready", worker=msg.name, num_blocks=msg.num_blocks, weight_bytes=msg.weight_bytes)
        return list(self.workers.values())

    @property
    def num_blocks(self) -> int:
        """Blocks every worker of the group can hold: the smallest budget wins."""
        return min(w.num_blocks for w in self.workers.values())

    def initialize_cache(self, num_blocks: int | None = None, timeout_s: float = 120.0,
                         on_wait: Callable[[], None] | None = None) -> int:
        """Have every worker allocate the same number of blocks and attach to a new ring; returns the blocks."""
        num_blocks = num_blocks or self.num_blocks
        num_remote = sum(w.node_rank != 0 for w in self.workers.values())
        self.ring = ShmBroadcastWriter.create(self.ring_prefix, self.world_size - num_remote, self.wakeup_address)
        if num_remote:
            try:
                self.remote = TcpBroadcastWriter(self.remote_address, num_remote, self.ctx)
            except zmq.ZMQError as e:
                raise WorkerGroupFailed(f"cannot bind the step stream {self.remote_address}: {e}") from e
        payload = encoder.encode(InitializeCache(num_blocks=num_blocks, ring_name=self.ring.name,
                                                 wakeup_address=self.wakeup_address,
                                                 remote_address=self.remote_address or ""))
        for identity in self.workers:
            self._send(identity, payload)
        done: set[bytes] = set()
        while len(done) < self.world_size:
            identity, msg = self._recv(timeout_s, on_wait)
            if isinstance(msg, CacheReady):
                done.add(identity)
            elif isinstance(msg, WorkerReady) and identity not in done:  # it still waits: ours did not reach it
                log.info("sent the cache size again", worker=msg.name)
                self._send(identity, payload)
        self.ring.wait_for_readers(timeout_s)
        if self.remote is not None:
            try:
                self.remote.wait_for_readers(timeout_s)
            except TimeoutError as e:
                raise WorkerGroupFailed(str(e)) from e
            self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.ring.unlink()  # every reader holds its mapping: nothing stays in /dev/shm after we all exit
        return num_blocks

    def execute(self, scheduler_output: SchedulerOutput, timeout_s: float | None = None) -> ModelRunnerOutput:
        """Send one step to every rank and return what the sampling rank sampled.

        Raises WorkerGroupFailed when a worker fails or dies.
        """
        self.submit(scheduler_output, timeout_s)
        return self.wait(scheduler_output.step_id, timeout_s)

    def submit(self, scheduler_output: SchedulerOutput, timeout_s: float | None = None) -> None:
        """Write a step into the ring; with PP > 1 the next one may follow before this one's answer."""
        try:
            data = encoder.encode(scheduler_output)
            self.ring.enqueue(data, timeout=timeout_s)
            if self.remote is not None:
                self.remote.enqueue(data)
        except (PeerDied, RingClosed, TimeoutError) as e:
            raise WorkerGroupFailed(f"the worker group stopped reading: {e}") from e

    def wait(self, step_id: int, timeout_s: float | None = None) -> ModelRunnerOutput:
        """The sampled tokens of step `step_id` (steps answer in the order they were submitted)."""
        while True:
            _, msg = self._recv(timeout_s)
            if isinstance(msg, ModelRunnerOutput) and msg.step_id == step_id:
                return msg

    def close(self, shutdown_workers: bool = True, tell_readers: bool = True) -> None:
        """Ask the workers to exit (when they can still hear it), then close the ring and the socket.
        Without `tell_readers` the workers find out only once this process has exited: a failing
        core's exit, not its workers', must be what the supervisor sees first."""
        if self.ring is not None:
            if shutdown_workers:
                try:
                    if self.remote is not None:
                        self.remote.enqueue(encoder.encode(Shutdown()))
                    self.ring.enqueue(encoder.encode(Shutdown()), timeout=1.0)
                except (PeerDied, RingClosed, TimeoutError):
                    pass  # a worker that is already gone needs no telling
            self.ring.close(tell_readers=tell_readers)
            self.ring = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None
        if self.monitor is not None:
            # stop the events first: libzmq's I/O thread sends each one blocking, and one for a monitor
            # whose reader is closed (a worker's connection dropping while this socket closes) blocks it
            # for good, with this port still bound: every new group failed to bind it (libzmq#3575)
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        self.sock.close()
