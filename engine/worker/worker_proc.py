"""`WorkerProc`: a Worker as its own process, the one `vsup serve` starts.

    python -m engine.worker --model DIR --dp-rank 0 --pp-rank 0 --tp-rank 1 \
        --tensor-parallel-size 2 --core-address ipc://RUN_DIR/dp0-workers.sock \
        --dist-init-method file://RUN_DIR/dp0-dist ...

It sets its title, logs JSON lines with its role and ranks, asks its engine
core which group generation to join, meets its peers under it, loads its
shard, reports READY with its memory figures, then serves the core's
messages until told to shut down.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import msgspec
import torch
import zmq

from engine import cluster
from engine.args import add_parallel_sizes, role_parser
from engine.load import LoadMeter, report_to_supervisor
from engine.log import configure
from engine.process import become, exit_on_sigterm, freeze_heap, stopping
from engine.ring.shm_broadcast import PeerDied, RingClosed, ShmBroadcastReader
from engine.ring.tcp_broadcast import TcpBroadcastReader
from engine.wire.worker_messages import (CacheReady, GroupEpoch, InitializeCache, JoinGroup, Shutdown, WorkerFailed,
                                         WorkerReady, encoder, from_ring, to_worker)
from engine.worker.step_watch import StepWatch
from engine.worker.worker import Worker, WorkerConfig

READY_AGAIN_S = 2.0
JOIN_AGAIN_S = 0.5  # cheap, and the whole group waits for the last rank to join


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = role_parser("engine.worker", "One worker of a vsup tree.")
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--pp-rank", type=int, default=0)
    p.add_argument("--tp-rank", type=int, default=0)
    add_parallel_sizes(p)
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--linear-dtype", default=None, choices=["bfloat16"],
                   help="the dtype a float32 model's linear layers compute in (a CPU with avx512_bf16 or AMX)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["bfloat16"],
                   help="the dtype the KV cache stores (default: the model's)")
    p.add_argument("--kv-cache-bytes", type=int, default=2**30, help="KV cache budget of this worker")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--core-address", required=True, help="the engine core's worker socket (ipc:// or tcp://)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this worker's node when its group spans nodes; not 0: steps come over tcp")
    p.add_argument("--dist-init-method", default=None, help="torch.distributed rendezvous, unique per deployment")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: cores / workers)")
    p.add_argument("--seed", type=int, default=0, help="random seed of requests that bring none")
    args, _unknown = p.parse_known_args(argv)  # flags meant for other roles pass through untouched
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    default_name = f"worker dp{args.dp_rank} pp{args.pp_rank} tp{args.tp_rank}"
    name = become(default_name)
    log = configure("worker", dp=args.dp_rank, pp=args.pp_rank, tp=args.tp_rank)
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    threads = args.num_threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, (os.cpu_count() or 1) // world)
    config = WorkerConfig(
        model=args.model, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size, tp_rank=args.tp_rank, pp_rank=args.pp_rank,
        dp_rank=args.dp_rank, device=args.device, dtype=args.dtype, linear_dtype=args.linear_dtype,
        kv_cache_dtype=args.kv_cache_dtype, kv_cache_bytes=args.kv_cache_bytes, block_size=args.block_size,
        dist_init_method=args.dist_init_method, num_threads=threads, name=name)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.setsockopt(zmq.LINGER, 1000)
    cluster.connect(sock, args.core_address)
    worker = Worker(config)
    torch.manual_seed(args.seed)
    exit_on_sigterm()  # stop cleanly: leave the ring, the socket and the process group
    epoch = ""
    try:
        log.info("starting", device=args.device, threads=threads if args.device == "cpu" else None,
                 cores=sorted(os.sched_getaffinity(0)) if args.device == "cpu" else None)
        epoch = join(sock, JoinGroup(name=name, pid=os.getpid()), log)
        if epoch is None:
            return 1
        log.info("joining the group", epoch=epoch)
        worker.init_device(epoch)
        worker.load_model()
        ready = msgspec.structs.replace(worker.ready_report(), node_rank=args.node_rank, epoch=epoch)
        sock.send(encoder.encode(ready))
        log.info("ready", num_blocks=ready.num_blocks, weight_bytes=ready.weight_bytes,
                 kv_bytes_per_block=ready.kv_bytes_per_block, rss_bytes=ready.rss_bytes)
        return 0 if serve(worker, sock, log, ready, args.node_rank) else 1  # its core vanished: a failure
    except Exception as e:
        log.exception("worker failed")
        sock.send(encoder.encode(WorkerFailed(name=name, error=f"{type(e).__name__}: {e}", pid=os.getpid(),
                                              epoch=epoch or "", joined=worker.groups is not None)))
        return 1
    finally:
        stopping()
        worker.shutdown()
        sock.close()
        ctx.term()


def join(sock: zmq.Socket, hello: JoinGroup, log) -> str | None:
    """The epoch of the group generation the core forms, or None when it says to exit. JoinGroup
    goes again every JOIN_AGAIN_S until the core answers: it may not be listening yet."""
    while True:
        sock.send(encoder.encode(hello))
        if not sock.poll(JOIN_AGAIN_S * 1000):
            continue
        msg = to_worker.decode_or_drop(sock.recv(), log)
        if isinstance(msg, GroupEpoch):
            return msg.epoch
        if isinstance(msg, Shutdown):
            log.warning("the engine core says to exit before joining")
            return None


def device_memory(worker: Worker, kv_cache_bytes: int) -> dict:
    """What this worker holds on its device, for `vsup ps`: weights and KV cache; on CUDA also what torch
    has reserved there."""
    figures = {"weight_bytes": worker.weight_bytes, "kv_cache_bytes": kv_cache_bytes}
    if worker.config.device.startswith("cuda"):
        figures["device_reserved_bytes"] = torch.cuda.memory_reserved(torch.device(worker.config.device))
    return figures


def serve(worker: Worker, sock: zmq.Socket, log, ready: WorkerReady, node_rank: int = 0) -> bool:
    """Allocate the cache when the core says how big, then run the steps it writes into
    the ring until Shutdown (True) or until the core is gone (False). A malformed message
    is logged and dropped, and so is a late answer to a JoinGroup sent again. READY goes
    again every few seconds until the core answers: a core that (re)started meanwhile may
    have missed it; one that forms another generation answers Shutdown (False)."""
    msg = None
    while not isinstance(msg, InitializeCache):
        if isinstance(msg, Shutdown):
            log.warning("the engine core forms a new group without this worker; exiting", epoch=ready.epoch)
            return False
        if not sock.poll(READY_AGAIN_S * 1000):
            sock.send(encoder.encode(ready))
            continue
        msg = to_worker.decode_or_drop(sock.recv(), log)
    nbytes = worker.initialize_cache(msg.num_blocks)
    if node_rank and msg.remote_address:  # the core's node is another one: no shared memory with it
        ring = TcpBroadcastReader(msg.remote_address, sock.context)
    else:
        ring = ShmBroadcastReader.attach(msg.ring_name, worker.config.rank, msg.wakeup_address)
    sock.send(encoder.encode(CacheReady(name=worker.config.name, num_blocks=msg.num_blocks, kv_cache_bytes=nbytes,
                                        epoch=ready.epoch)))
    freeze_heap()
    meter = LoadMeter()
    report_to_supervisor(meter, lambda: device_memory(worker, nbytes))
    # a remote worker's ring has no such word: its stuck step waits for the collective's timeout
    watch = StepWatch(ring.abandoned, log) if isinstance(ring, ShmBroadcastReader) else contextlib.nullcontext()
    try:
        while True:
            try:
                raw = ring.dequeue()
            except (PeerDied, RingClosed) as e:
                log.warning("engine core is gone or gave up this group; exiting", reason=str(e))
                return False
            step = from_ring.decode_or_drop(raw, log)
            if step is None:
                continue
            if isinstance(step, Shutdown):
                stopping()  # (the supervisor's SIGTERM may come while this worker closes its ring)
                log.info("shutting down")
                return True
            with watch, meter.busy("forward"):
                result = worker.execute(step)
            if result is not None:
                sock.send(encoder.encode(result))
    finally:
        if isinstance(watch, StepWatch):
            watch.close()
        ring.close()


if __name__ == "__main__":
    sys.exit(main())
