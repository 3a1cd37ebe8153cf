"""`python -m engine.coordinator`: gathers every engine core's load and publishes it to every API server.

Cores PUSH a CoreLoad when their counts change; the coordinator PUBlishes
all ranks' [waiting, running] (and their step and request counters) at most
every 100 ms while they change, and once a second otherwise, so API servers
route each request to the least-loaded rank. It holds no request state:
restarting it loses nothing.

With --dp-lockstep it also runs the waves (engine/coordinator/waves.py):
cores PUSH WaveReports on the same socket, and it PUBlishes WaveGo/WaveEnd
on --wave-address, where the cores subscribe.
"""

from __future__ import annotations

import time
import uuid

import structlog
import zmq

from engine import cluster
from engine.args import add_parallel_sizes, role_parser
from engine.coordinator.waves import WaveBarrier
from engine.load import LoadMeter, report_to_supervisor
from engine.log import configure
from engine.process import become, exit_on_sigterm, stopping
from engine.wire.protocol import CoreLoad, LoadStats, WaveReport, encoder, to_coordinator

log = structlog.get_logger("coordinator")
PUBLISH_S = 0.1
HEARTBEAT_S = 1.0


class Coordinator:
    def __init__(self, input_address: str, output_address: str, data_parallel_size: int,
                 wave_address: str | None = None):
        """`wave_address`: where to publish step waves, only with --dp-lockstep (else None)."""
        self.ctx = zmq.Context()
        self.guard = cluster.Guard(self.ctx).start()  # tcp:// peers without the cluster secret are refused
        self.input = self.ctx.socket(zmq.PULL)
        cluster.bind(self.input, input_address)
        self.guard.watch(self.input, input_address)
        self.output = self.ctx.socket(zmq.PUB)
        self.output.setsockopt(zmq.LINGER, 0)
        cluster.bind(self.output, output_address)
        self.guard.watch(self.output, output_address)
        self.ranks: dict[int, list[int]] = {r: [0, 0] for r in range(data_parallel_size)}
        self.counters: dict[int, list[int]] = {r: [0, 0, 0] for r in range(data_parallel_size)}
        self.waves = self.barrier = None
        if wave_address:  # --dp-lockstep
            self.waves = self.ctx.socket(zmq.PUB)
            self.waves.setsockopt(zmq.LINGER, 0)
            cluster.bind(self.waves, wave_address)
            self.guard.watch(self.waves, wave_address)
            self.barrier = WaveBarrier(range(data_parallel_size), epoch=uuid.uuid4().hex[:12])
        self.meter = LoadMeter()  # waves and load messages per second, for `vsup ps`
        self.counted = (0, 0)  # the barrier's waves and steps counted so far

    def run(self) -> None:
        changed, last_publish = False, 0.0
        while True:
            wait = last_publish + (PUBLISH_S if changed else HEARTBEAT_S) - time.monotonic()
            if self.barrier is not None:
                wait = min(wait, self.barrier.seconds_to_tick())
            if self.input.poll(max(0.0, wait) * 1000):
                changed |= self.receive()
            if self.barrier is not None:
                self.send_waves(self.barrier.tick())
                waves, steps = self.barrier.num_waves, self.barrier.num_steps
                self.meter.count("waves", waves - self.counted[0])
                self.meter.count("steps", steps - self.counted[1])
                self.counted = (waves, steps)
            if time.monotonic() - last_publish >= (PUBLISH_S if changed else HEARTBEAT_S):
                self.output.send(encoder.encode(LoadStats(ranks=self.ranks, published_at=time.time(),
                                                          counters=self.counters)))
                changed, last_publish = False, time.monotonic()

    def receive(self) -> bool:
        """Take every queued message; True when a rank's load or counters changed."""
        changed = False
        while True:
            try:
                raw = self.input.recv(zmq.NOBLOCK)
            except zmq.Again:
                return changed
            msg = to_coordinator.decode_or_drop(raw, log)
            if msg is None:
                continue
            if isinstance(msg, WaveReport):
                if self.barrier is not None:
                    self.send_waves(self.barrier.on_report(msg))
                continue
            assert isinstance(msg, CoreLoad)
            self.meter.count("load_reports")
            if self.barrier is not None:
                self.barrier.heard(msg.dp_rank)
            counts = [msg.num_waiting, msg.num_running]
            counters = [msg.num_steps, msg.num_dummy_steps, msg.num_requests]
            changed |= self.ranks.get(msg.dp_rank) != counts or self.counters.get(msg.dp_rank) != counters
            self.ranks[msg.dp_rank], self.counters[msg.dp_rank] = counts, counters

    def send_waves(self, messages) -> None:
        for msg in messages:
            self.waves.send(encoder.encode(msg))

    def close(self) -> None:
        for sock in (self.input, self.output, self.waves):
            if sock is not None:
                self.guard.unwatch(sock)
        self.input.close(linger=0)
        self.output.close()
        if self.waves is not None:
            self.waves.close()
        self.guard.stop()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    p = role_parser("engine.coordinator", "The coordinator of a vsup tree (DP > 1).")
    p.add_argument("--input-address", required=True, help="where engine cores push their load")
    p.add_argument("--output-address", required=True, help="where API servers subscribe to all ranks' load")
    p.add_argument("--wave-address", default=None, help="where engine cores subscribe to step waves")
    p.add_argument("--dp-lockstep", action="store_true",
                   help="step every DP rank together while any has work (dummy steps on idle ranks)")
    add_parallel_sizes(p)
    args, _unknown = p.parse_known_args(argv)
    become("coordinator")
    configure("coordinator")
    exit_on_sigterm()
    coordinator = Coordinator(args.input_address, args.output_address, args.data_parallel_size,
                              wave_address=args.wave_address if args.dp_lockstep else None)
    log.info("ready", ranks=args.data_parallel_size, lockstep=coordinator.barrier is not None,
             epoch=coordinator.barrier.epoch if coordinator.barrier else None)
    report_to_supervisor(coordinator.meter, lambda: {"lockstep": coordinator.barrier is not None})
    try:
        coordinator.run()
    except KeyboardInterrupt:
        pass
    finally:
        stopping()
        coordinator.close()
    return 0
