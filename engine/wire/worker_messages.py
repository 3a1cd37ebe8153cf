"""Messages between an engine core and its workers, besides the step itself.

Each worker holds one DEALER socket to its engine core's ROUTER. It first asks
which generation of its group to join (JoinGroup, answered by GroupEpoch), meets
its peers under that epoch, then sends READY; the core sends InitializeCache,
and the worker sends failures and (from the sampling rank) sampled tokens back.
Steps and Shutdown then come through the shared-memory ring that InitializeCache
names (engine.ring.shm_broadcast). msgpack through msgspec, tagged, never pickle.

The epoch is why a group heals when its ranks live on several nodes, each
restarted by its own supervisor: a rank of the new group never meets a rank of
the lost one that has not exited yet (it waits under another key in the
rendezvous store), and the core drops what such a rank still sends.
"""

from __future__ import annotations

import msgspec

from engine.wire.decoder import Decoder
from engine.wire.protocol import Shutdown
from engine.wire.scheduler_output import ModelRunnerOutput, SchedulerOutput


class JoinGroup(msgspec.Struct, tag="join"):
    """A worker's first message, sent again until answered: which group generation to join."""

    name: str
    pid: int


class GroupEpoch(msgspec.Struct, tag="epoch"):
    """The core's answer: the generation being formed, a new one each time the core loses its group."""

    epoch: str


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
    epoch: str = ""            # the generation it joined (GroupEpoch)


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
    epoch: str = ""


class WorkerFailed(msgspec.Struct, tag="failed"):
    """A worker could not do what it was asked; it exits after sending this. One that failed before it
    joined its peers (`joined` false: its rendezvous broke) spoils nothing: the core waits for its restart."""

    name: str
    error: str
    pid: int = 0
    epoch: str = ""
    joined: bool = True


Step = SchedulerOutput | Shutdown
FromWorker = JoinGroup | WorkerReady | CacheReady | ModelRunnerOutput | WorkerFailed

encoder = msgspec.msgpack.Encoder()
to_worker = Decoder(GroupEpoch | InitializeCache | Shutdown)  # what the socket brings a worker
from_ring = Decoder(Step)
from_worker = Decoder(FromWorker)
