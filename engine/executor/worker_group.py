"""The engine core's end of its workers: one ROUTER socket, one DEALER per worker.

Someone else starts the worker processes (the supervisor, or a test); the
group only binds the address they connect to, waits for every READY, sizes
the KV cache to the smallest budget, then sends each step to every rank and
takes the sampled tokens from the sampling rank.
"""

from __future__ import annotations

import time

import msgspec
import structlog
import zmq

from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.worker.messages import (CacheReady, InitializeCache, Shutdown, WorkerFailed, WorkerReady,
                                    encoder, from_worker)

log = structlog.get_logger("engine-core")


class WorkerGroupFailed(RuntimeError):
    """A worker reported a failure, or the group did not answer in time."""


class WorkerGroup:
    """Talks to the TP x PP workers of one engine core."""

    def __init__(self, address: str, world_size: int, pipeline_parallel_size: int = 1,
                 ctx: zmq.Context | None = None):
        self.world_size = world_size
        self.last_stage = pipeline_parallel_size - 1
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker raises, not vanishes
        self.sock.bind(address)
        self.address = address
        self.workers: dict[bytes, WorkerReady] = {}

    def _recv(self, timeout_s: float | None) -> tuple[bytes, object]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = None if deadline is None else max(0, deadline - time.monotonic()) * 1000
            if not self.sock.poll(wait):
                raise WorkerGroupFailed(f"no answer from the workers within {timeout_s} s")
            identity, raw = self.sock.recv_multipart()
            try:
                msg = from_worker.decode(raw)
            except msgspec.DecodeError as e:
                log.warning("dropped malformed message", sender=identity.decode(errors="replace"), error=str(e))
                continue
            if isinstance(msg, WorkerFailed):
                raise WorkerGroupFailed(f"{msg.name}: {msg.error}")
            return identity, msg

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

    def _broadcast(self, msg) -> None:
        payload = encoder.encode(msg)
        for identity in self.workers:
            self.sock.send_multipart([identity, payload])

    def initialize_cache(self, num_blocks: int | None = None, timeout_s: float = 120.0) -> int:
        """Have every worker allocate the same number of blocks; returns it."""
        num_blocks = num_blocks or self.num_blocks
        self._broadcast(InitializeCache(num_blocks=num_blocks))
        done = 0
        while done < self.world_size:
            _, msg = self._recv(timeout_s)
            done += isinstance(msg, CacheReady)
        return num_blocks

    def execute(self, scheduler_output: SchedulerOutput, timeout_s: float | None = None) -> ModelRunnerOutput:
        """Send one step to every rank and return what the sampling rank sampled."""
        self._broadcast(scheduler_output)
        while True:
            _, msg = self._recv(timeout_s)
            if isinstance(msg, ModelRunnerOutput) and msg.step_id == scheduler_output.step_id:
                return msg

    def shutdown(self) -> None:
        """Ask every worker to exit, then close the socket."""
        try:
            self._broadcast(Shutdown())
        except zmq.ZMQError:
            pass  # a worker that is already gone needs no telling
        self.sock.close()
