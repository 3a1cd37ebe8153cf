"""The engine core's end of its workers: a ROUTER socket and a shared-memory ring.

Someone else starts the worker processes (the supervisor, or a test); the
group binds the address they connect to, waits for every READY, sizes the
KV cache to the smallest budget, then writes each step once into the ring
that every rank reads, and takes the sampled tokens from the sampling rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import psutil
import structlog
import zmq

from engine.executor.shm_broadcast import PeerDied, RingClosed, ShmBroadcastWriter
from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.worker.messages import (CacheReady, InitializeCache, Shutdown, WorkerFailed, WorkerReady,
                                    encoder, from_worker)

log = structlog.get_logger("engine-core")
CHECK_S = 0.5  # while waiting, look this often whether every worker still lives


class WorkerGroupFailed(RuntimeError):
    """A worker reported a failure, died, or the group did not answer in time."""


class WorkerGroup:
    """Talks to the TP x PP workers of one engine core."""

    def __init__(self, address: str, world_size: int, *, ring_prefix: str, wakeup_address: str,
                 ctx: zmq.Context | None = None, interrupt: zmq.Socket | None = None,
                 on_interrupt: Callable[[], None] | None = None):
        """`on_interrupt` runs whenever `interrupt` is readable while the group waits;
        it may raise (WorkerGroupFailed, say) to abandon the wait."""
        self.world_size = world_size
        self.interrupt, self.on_interrupt = interrupt, on_interrupt
        self.ring_prefix, self.wakeup_address = ring_prefix, wakeup_address
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker raises, not vanishes
        self.sock.bind(address)
        self.address = address
        self.workers: dict[bytes, WorkerReady] = {}
        self.ring: ShmBroadcastWriter | None = None

    def _recv(self, timeout_s: float | None) -> tuple[bytes, object]:
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
                continue
            identity, raw = self.sock.recv_multipart()
            try:
                msg = from_worker.decode(raw)
            except msgspec.DecodeError as e:
                log.warning("dropped malformed message", sender=identity.decode(errors="replace"), error=str(e))
                continue
            if isinstance(msg, WorkerFailed):
                raise WorkerGroupFailed(f"{msg.name}: {msg.error}")
            return identity, msg

    def _check_alive(self) -> None:
        """A worker that died without a word (kill -9) is found by its pid, not by waiting forever."""
        for ready in self.workers.values():
            try:
                dead = psutil.Process(ready.pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                dead = True
            if dead:
                raise WorkerGroupFailed(f"{ready.name} (pid {ready.pid}) died")

    def wait_for_ready(self, timeout_s: float = 300.0) -> list[WorkerReady]:
        """Block until all ranks said READY; raises WorkerGroupFailed on a failure or timeout."""
        deadline = time.monotonic() + timeout_s
        while len(self.workers) < self.world_size:
            identity, msg = self._recv(max(0.0, deadline - time.monotonic()))
            if isinstance(msg, WorkerReady):
                self.workers[identity] = msg
                log.info("worker ready", worker=msg.name, num_blocks=msg.num_blocks, weight_bytes=msg.weight_bytes)
        return list(self.workers.values())

    @property
    def num_blocks(self) -> int:
        """Blocks every worker of the group can hold: the smallest budget wins."""
        return min(w.num_blocks for w in self.workers.values())

    def initialize_cache(self, num_blocks: int | None = None, timeout_s: float = 120.0) -> int:
        """Have every worker allocate the same number of blocks and attach to a new ring; returns the blocks."""
        num_blocks = num_blocks or self.num_blocks
        self.ring = ShmBroadcastWriter.create(self.ring_prefix, self.world_size, self.wakeup_address)
        payload = encoder.encode(InitializeCache(num_blocks=num_blocks, ring_name=self.ring.name,
                                                 wakeup_address=self.wakeup_address))
        for identity in self.workers:
            self.sock.send_multipart([identity, payload])
        done = 0
        while done < self.world_size:
            _, msg = self._recv(timeout_s)
            done += isinstance(msg, CacheReady)
        self.ring.wait_for_readers(timeout_s)
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
            self.ring.enqueue(encoder.encode(scheduler_output), timeout=timeout_s)
        except (PeerDied, RingClosed, TimeoutError) as e:
            raise WorkerGroupFailed(f"the worker group stopped reading: {e}") from e

    def wait(self, step_id: int, timeout_s: float | None = None) -> ModelRunnerOutput:
        """The sampled tokens of step `step_id` (steps answer in the order they were submitted)."""
        while True:
            _, msg = self._recv(timeout_s)
            if isinstance(msg, ModelRunnerOutput) and msg.step_id == step_id:
                return msg

    def close(self, shutdown_workers: bool = True) -> None:
        """Ask the workers to exit (when they can still hear it), then close the ring and the socket."""
        if self.ring is not None:
            if shutdown_workers:
                try:
                    self.ring.enqueue(encoder.encode(Shutdown()), timeout=1.0)
                except (PeerDied, RingClosed, TimeoutError):
                    pass  # a worker that is already gone needs no telling
            self.ring.close()
            self.ring = None
        self.sock.close()
