"""`python -m engine.coordinator`: gathers every engine core's load and publishes it to every API server.

Cores PUSH a CoreLoad when their counts change; the coordinator PUBlishes
all ranks' [waiting, running] at most every 100 ms while they change, and
once a second otherwise, so API servers route each request to the
least-loaded rank. It holds no request state: restarting it loses nothing.
"""

from __future__ import annotations

import time

import msgspec
import structlog
import zmq

from engine.args import add_parallel_sizes, role_parser
from engine.log import configure
from engine.process import become
from engine.protocol import LoadStats, coordinator_in, encoder

log = structlog.get_logger("coordinator")
PUBLISH_S = 0.1
HEARTBEAT_S = 1.0


class Coordinator:
    def __init__(self, input_address: str, output_address: str, data_parallel_size: int):
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.bind(input_address)
        self.output = self.ctx.socket(zmq.PUB)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(output_address)
        self.ranks: dict[int, list[int]] = {r: [0, 0] for r in range(data_parallel_size)}

    def run(self) -> None:
        changed, last_publish = False, 0.0
        while True:
            wait = PUBLISH_S if changed else HEARTBEAT_S
            if self.input.poll(max(0.0, last_publish + wait - time.monotonic()) * 1000):
                raw = self.input.recv()
                try:
                    load = coordinator_in.decode(raw)
                except msgspec.DecodeError as e:
                    log.warning("dropped malformed message", error=str(e))
                    continue
                counts = [load.num_waiting, load.num_running]
                changed |= self.ranks.get(load.dp_rank) != counts
                self.ranks[load.dp_rank] = counts
            if time.monotonic() - last_publish >= (PUBLISH_S if changed else HEARTBEAT_S):
                self.output.send(encoder.encode(LoadStats(ranks=self.ranks, published_at=time.time())))
                changed, last_publish = False, time.monotonic()

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    p = role_parser("engine.coordinator", "The coordinator of a vsup tree (DP > 1).")
    p.add_argument("--input-address", required=True, help="where engine cores push their load")
    p.add_argument("--output-address", required=True, help="where API servers subscribe to all ranks' load")
    add_parallel_sizes(p)
    args, _unknown = p.parse_known_args(argv)
    become("coordinator")
    configure("coordinator")
    coordinator = Coordinator(args.input_address, args.output_address, args.data_parallel_size)
    log.info("ready", ranks=args.data_parallel_size)
    try:
        coordinator.run()
    except KeyboardInterrupt:
        pass
    finally:
        coordinator.close()
    return 0
