"""Messages between API servers and engine cores (DESIGN.md section 5).

Each engine core connects one DEALER socket (identity `dp<rank>`) to every
API server's ROUTER. It says `Hello` when it starts, `Ready` once its
workers are up, then takes requests and sends outputs on the same socket.
A new instance id in Hello tells an API server that the core was replaced,
so it resubmits what the old one held. msgpack through msgspec; no pickle.
"""

from __future__ import annotations

import msgspec

from engine.core.request import RequestUpdate
from engine.core.scheduler import SchedulerStats
from engine.sampling.params import SamplingParams

# core -> API server: lifecycle


class Hello(msgspec.Struct, tag="hello"):
    """A core (re)started; `instance` is new on every start."""

    dp_rank: int
    instance: str
    pid: int


class Ready(msgspec.Struct, tag="ready"):
    """The core's workers are up and its KV cache is allocated: send requests."""

    dp_rank: int
    instance: str
    max_model_len: int
    num_blocks: int
    block_size: int


class Failed(msgspec.Struct, tag="failed"):
    """The core cannot serve (its workers never came back): route around it."""

    dp_rank: int
    error: str


# API server -> core


class AddRequest(msgspec.Struct, tag="add", omit_defaults=True):
    """A new request, or one resubmitted to a replacement core.

    A resubmitted request carries the tokens already streamed to the client
    in `output_token_ids`: the core recomputes them and goes on from there.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = []
    arrival_time: float = 0.0


class AbortRequests(msgspec.Struct, tag="abort"):
    req_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility", omit_defaults=True):
    """Call a named engine-core method (`get_stats`, `reset_prefix_cache`, ...)."""

    call_id: int
    method: str
    args: list = []


# core -> API server: results


class Outputs(msgspec.Struct, tag="outputs", omit_defaults=True):
    """New tokens and finishes of the requests this API server sent, and the core's load."""

    dp_rank: int
    outputs: list[RequestUpdate] = []
    stats: SchedulerStats | None = None
    num_steps: int = 0


class UtilityResult(msgspec.Struct, tag="utility_result", omit_defaults=True):
    call_id: int
    result: object = None
    error: str | None = None


ToCore = AddRequest | AbortRequests | UtilityCall
FromCore = Hello | Ready | Failed | Outputs | UtilityResult

encoder = msgspec.msgpack.Encoder()
to_core = msgspec.msgpack.Decoder(ToCore)
from_core = msgspec.msgpack.Decoder(FromCore)


# supervisor -> core, on the core's control socket (vsup encodes these as plain msgpack maps)


class WorkersLost(msgspec.Struct, tag="workers_lost"):
    """The core's worker group died: requeue everything and wait for the new group's READY."""

    reason: str = ""


class Stop(msgspec.Struct, tag="stop"):
    """Finish: tell the workers to exit, then exit."""


ToControl = WorkersLost | Stop
control = msgspec.msgpack.Decoder(ToControl)


# engine cores -> coordinator -> API servers (DP > 1)


class CoreLoad(msgspec.Struct, tag="core_load", array_like=True):
    """One core's queue lengths, pushed to the coordinator when they change (and every second)."""

    dp_rank: int
    num_waiting: int
    num_running: int
    num_steps: int


class LoadStats(msgspec.Struct, tag="load_stats"):
    """Every rank's [waiting, running], published to the API servers for least-loaded routing."""

    ranks: dict[int, list[int]]
    published_at: float


coordinator_in = msgspec.msgpack.Decoder(CoreLoad)
coordinator_out = msgspec.msgpack.Decoder(LoadStats)
