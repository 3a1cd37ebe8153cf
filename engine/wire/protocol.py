"""Messages between API servers and engine cores (docs/ARCHITECTURE.md, the wire).

Each engine core connects one DEALER socket (identity `dp<rank>`) to every
API server's ROUTER. It says `Hello` when it starts, `Ready` once its
workers are up, then takes requests and sends outputs on the same socket.
A new instance id in Hello tells an API server that the core was replaced,
so it resubmits what the old one held. msgpack through msgspec; no pickle.
"""

from __future__ import annotations

import enum

import msgspec

from engine.wire.decoder import Decoder
from engine.wire.sampling_params import SamplingParams
from engine.wire.scheduler_output import TokenLogprobs

# what a request gained, and the scheduler's figures


class FinishReason(enum.StrEnum):
    """Why a request ended: OpenAI's "stop" and "length", vLLM's "abort" and "error"."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class RequestUpdate(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request gained in one step, for the engine core to pass to its API server.

    `new_token_ids` keep a final stop or EOS token: the API server decides
    whether to show it. `error` says why when finish_reason is "error".
    `stop_reason` is the stop token id that ended it (not EOS: vLLM's
    meaning). `prompt_logprobs` come once, with the first new token: those
    of prompt tokens 1.. (the first has none).
    """

    req_id: str
    new_token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs | None] = []
    error: str | None = None
    stop_reason: int | None = None
    prompt_logprobs: list[TokenLogprobs] = []


class SchedulerStats(msgspec.Struct, frozen=True):
    """A snapshot for logs and metrics; the prefix-cache and preemption numbers are cumulative.
    It goes to the API servers with every batch of outputs."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int


# core -> API server: lifecycle


class Hello(msgspec.Struct, tag="hello", omit_defaults=True):
    """A core (re)started; `instance` is new on every start. `fingerprint` is what every node must
    agree on (engine/cluster.py): an API server refuses a core whose fingerprint differs from its own."""

    dp_rank: int
    instance: str
    pid: int
    fingerprint: dict[str, str] = {}
    node: str = ""


class Ready(msgspec.Struct, tag="ready", omit_defaults=True):
    """The core's workers are up and its KV cache is allocated: send requests. `draining`: it finishes
    what runs and starts nothing new before a restart (`vsup restart`): send requests elsewhere if any
    other rank can take them (they would wait here for the restart). It names its process as Hello
    does: an API server that missed the Hello (it restarted, or a reconnection lost it) learns the
    core's pid and node from the next heartbeat."""

    dp_rank: int
    instance: str
    max_model_len: int
    num_blocks: int
    block_size: int
    fingerprint_hash: str = ""
    draining: bool = False
    pid: int | None = None
    node: str = ""


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


class Refused(msgspec.Struct, tag="refused"):
    """The API server will not serve with this core: its plan or model differs (`reason` says how)."""

    reason: str


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


ToCore = AddRequest | AbortRequests | UtilityCall | Refused
FromCore = Hello | Ready | Failed | Outputs | UtilityResult

encoder = msgspec.msgpack.Encoder()
to_core = Decoder(ToCore)
from_core = Decoder(FromCore)


# supervisor -> core, on the core's control socket (vsup encodes these as plain msgpack maps)


class WorkersLost(msgspec.Struct, tag="workers_lost"):
    """The core's worker group died: requeue everything and wait for the new group's READY."""

    reason: str = ""


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Exit, one word for every receiver. To an engine core (its control socket): tell the workers to
    exit, then exit. To a worker, through the ring: the end of serving; on its socket: the answer to a
    READY of a generation the core no longer forms (the worker exits 1 and its supervisor starts one
    that joins the new one)."""


class Drain(msgspec.Struct, tag="drain"):
    """Finish the running requests and start no new one; say "drained" (a log event) when none runs. The
    supervisor then restarts the core or its workers (`vsup restart`); what waits goes on after."""


ToControl = WorkersLost | Shutdown | Drain
control = Decoder(ToControl)


# engine cores -> coordinator -> API servers (DP > 1)


class CoreLoad(msgspec.Struct, tag="core_load", array_like=True):
    """One core's queue lengths, pushed to the coordinator when they change (and every second),
    and its cumulative counters: steps with a real batch, dummy steps (--dp-lockstep: a rank with
    no work steps with the others), requests taken. Also the core's heartbeat to the coordinator."""

    dp_rank: int
    num_waiting: int
    num_running: int
    num_steps: int
    num_dummy_steps: int = 0
    num_requests: int = 0


class LoadStats(msgspec.Struct, tag="load_stats"):
    """Every rank's [waiting, running], published to the API servers for least-loaded routing,
    and every rank's cumulative [steps, dummy steps, requests] (for /metrics)."""

    ranks: dict[int, list[int]]
    published_at: float
    counters: dict[int, list[int]] = {}


coordinator_out = Decoder(LoadStats)


# --dp-lockstep: the wave protocol. While any rank has work, every live rank runs one step (a dummy
# when it has none) per `WaveGo`, reports it with a `WaveReport`, and waits for the next go.
# Cores PUSH reports on their coordinator socket; the coordinator PUBlishes gos on --wave-address.


class WaveReport(msgspec.Struct, tag="wave_report", array_like=True):
    """A core ran step `step` of wave `wave` (of the coordinator instance `epoch`) and now has work
    or not. step = -1 (nothing run yet in that epoch) with has_work: "I have work, start a wave".
    A core with new work after reporting none says so again at once."""

    dp_rank: int
    epoch: str
    wave: int
    step: int
    has_work: bool


class WaveGo(msgspec.Struct, tag="wave_go", array_like=True):
    """Every rank: run step `step` of wave `wave`. `ranks` are those the barrier waits for.
    Published again while the barrier waits, so a rank that (re)joins syncs to it."""

    epoch: str
    wave: int
    step: int
    ranks: list[int]


class WaveEnd(msgspec.Struct, tag="wave_end", array_like=True):
    """No live rank had work after the last step of wave `wave`: idle ranks stop stepping."""

    epoch: str
    wave: int


to_coordinator = Decoder(CoreLoad | WaveReport)
from_waves = Decoder(WaveGo | WaveEnd)
