"""Messages between an engine core and its workers, besides the step itself.

Each worker holds one DEALER socket to its engine core's ROUTER: the core
sends InitializeCache down it, the worker sends READY, failures and (from
the sampling rank) sampled tokens back. Steps and Shutdown then come through
the shared-memory ring that InitializeCache names (engine.executor.shm_broadcast).
msgpack through msgspec, tagged, never pickle.
"""

from __future__ import annotations

import msgspec

from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.wire import Decoder


class WorkerReady(msgspec.Struct, tag="ready"):
    """A worker has its weights loaded and tells what its KV budget holds."""

    name: str
    pid: int
    dp: int
    pp: int
    tp: int
    device: str
    num_blocks: int            # blocks its --kv-cache-memory budget holds
    block_size: int
    weight_bytes: int
    kv_bytes_per_block: int
    rss_bytes: int
    load_seconds: float
    node_rank: int = 0         # its node in a group that spans nodes (--nnodes); the core's is 0


class InitializeCache(msgspec.Struct, tag="init_cache"):
    """Allocate this many KV blocks (the smallest any worker of the group can hold),
    then read every step from the shared-memory ring `ring_name` (on another node than the
    core's: from `remote_address`)."""

    num_blocks: int
    ring_name: str
    wakeup_address: str
    remote_address: str = ""   # workers on other nodes read the steps here instead (tcp_broadcast.py)


class CacheReady(msgspec.Struct, tag="cache_ready"):
    name: str
    num_blocks: int
    kv_cache_bytes: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class WorkerFailed(msgspec.Struct, tag="failed"):
    """A worker could not do what it was asked; it exits after sending this."""

    name: str
    error: str


Step = SchedulerOutput | Shutdown
FromWorker = WorkerReady | CacheReady | ModelRunnerOutput | WorkerFailed

encoder = msgspec.msgpack.Encoder()
to_worker = Decoder(InitializeCache)  # the only message the socket brings a worker
from_ring = Decoder(Step)
from_worker = Decoder(FromWorker)
