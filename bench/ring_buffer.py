"""Round trip through the shared-memory ring against ZeroMQ ipc PUSH/PULL, side by side in one run.

An echo process sends each message straight back: over a second ring for the ring (one writer and
one reader each way), over a second PUSH/PULL pair for ZeroMQ. The two alternate in blocks of
`--block` trips, so machine noise hits both alike; the figure that counts is the ratio of medians.
From about 1 MB on, both mostly measure the allocator: every message arrives as a fresh bytes
object, which glibc may map and fault in anew each time (so the 4 MB row swings from run to run).

    python bench/ring_buffer.py [--quick | --smoke] [--trips 400] [--block 100] [--sizes 1024,16384,...]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import zmq

from common import add_mode_args, conditions, mode, write_results
from engine.ring.shm_broadcast import RingClosed, ShmBroadcastReader, ShmBroadcastWriter


def ring_echo(name: str, there: str, back_prefix: str, back: str, conn) -> None:
    """Read each message from ring `name` and write it back on a ring of our own, until closed."""
    reader = ShmBroadcastReader.attach(name, 0, there)
    writer = ShmBroadcastWriter.create(back_prefix, 1, back, slot_bytes=1 << 20, num_slots=8)
    conn.send(writer.name)
    writer.wait_for_readers(30)
    writer.unlink()
    try:
        while True:
            writer.enqueue(reader.dequeue())
    except RingClosed:
        pass
    finally:
        reader.close()
        writer.close()


def zmq_echo(there: str, back: str) -> None:
    """PULL each message and PUSH it back, until an empty one."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(there)
    push.connect(back)
    while message := pull.recv():
        push.send(message)
    ctx.destroy(linger=0)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trips", type=int, default=400, help="round trips per size and transport")
    parser.add_argument("--block", type=int, default=100, help="trips in a row before switching transport")
    parser.add_argument("--sizes", default="1024,16384,262144,1048576,4194304")
    add_mode_args(parser)
    args = parser.parse_args(argv)
    run_mode = mode(args)
    if run_mode == "smoke":
        args.trips, args.block, args.sizes = 10, 5, "1024,65536"
    elif args.quick:
        args.trips = 100
    results = {"conditions": conditions(), "trips": args.trips, "block": args.block, "rows": []}
    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        there, back = f"ipc://{tmp}/ring-there.sock", f"ipc://{tmp}/ring-back.sock"
        out = ShmBroadcastWriter.create(f"vsup-bench-{os.getpid()}", 1, there, slot_bytes=1 << 20, num_slots=8)
        mine, theirs = spawn.Pipe()
        ring_proc = spawn.Process(target=ring_echo, args=(out.name, there, f"vsup-bench-{os.getpid()}-back",
                                                          back, theirs))
        ring_proc.start()
        inbound = ShmBroadcastReader.attach(mine.recv(), 0, back)
        out.wait_for_readers(30)
        out.unlink()

        ctx = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind(f"ipc://{tmp}/zmq-there.sock")
        pull.bind(f"ipc://{tmp}/zmq-back.sock")
        zmq_proc = spawn.Process(target=zmq_echo, args=(f"ipc://{tmp}/zmq-there.sock", f"ipc://{tmp}/zmq-back.sock"))
        zmq_proc.start()

        def ring_trip(data: bytes) -> float:
            start = time.perf_counter()
            out.enqueue(data)
            assert len(inbound.dequeue()) == len(data)
            return time.perf_counter() - start

        def zmq_trip(data: bytes) -> float:
            start = time.perf_counter()
            push.send(data)
            assert len(pull.recv()) == len(data)
            return time.perf_counter() - start

        print(f"round trip, median (p90) in us; {args.trips} trips per cell, {os.cpu_count()} CPUs")
        print(f"{'size':>9}  {'shm ring':>17}  {'zmq ipc':>17}  {'zmq/ring':>8}")
        try:
            for size in map(int, args.sizes.split(",")):
                data = os.urandom(size)
                for trip in (ring_trip, zmq_trip) * 5:  # warm up both paths
                    trip(data)
                times: dict = {ring_trip: [], zmq_trip: []}
                for _ in range(max(1, args.trips // args.block)):
                    for trip, spent in times.items():
                        spent += [trip(data) for _ in range(args.block)]
                ring_us, zmq_us = ([v * 1e6 for v in t] for t in times.values())
                ring_p50, zmq_p50 = statistics.median(ring_us), statistics.median(zmq_us)
                print(f"{size:>9}  {ring_p50:>8.1f} ({percentile(ring_us, 90):>6.1f})  "
                      f"{zmq_p50:>8.1f} ({percentile(zmq_us, 90):>6.1f})  {zmq_p50 / ring_p50:>7.2f}x")
                results["rows"].append({"bytes": size, "ring_median_us": ring_p50, "ring_p90_us": percentile(ring_us, 90),
                                        "ring_p99_us": percentile(ring_us, 99), "zmq_median_us": zmq_p50,
                                        "zmq_p90_us": percentile(zmq_us, 90), "zmq_p99_us": percentile(zmq_us, 99),
                                        "zmq_over_ring_median": zmq_p50 / ring_p50})
        finally:
            out.close()  # the ring echo reads RingClosed and exits
            push.send(b"")
            ring_proc.join(10)
            zmq_proc.join(10)
            inbound.close()
            ctx.destroy(linger=0)
    write_results("ring_buffer", results, run_mode)


if __name__ == "__main__":
    main()
