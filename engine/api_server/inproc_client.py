"""`InprocClient`: in-process mode, the engine core inside the API server.

With TP = PP = 1 its one worker is inside too; with more, the workers are
their own processes and connect to this process as they would to an engine
core. One background thread owns the EngineCore (and so torch): it builds
it, takes commands from a queue, steps while there is work, and hands
outputs to the event loop. Only this thread ever touches the core, so
scheduling order is repeatable, as in-process mode promises. DP = 1.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from engine.api_server.client_base import ClientBase
from engine.api_server.request_stream import RequestStream
from engine.args import DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES
from engine.wire.protocol import AddRequest, FinishReason
from engine.wire.sampling_params import SamplingParams

log = structlog.get_logger("api-server")
HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class InprocConfig:
    """What the in-process engine core and worker are built from (the engine flags of argv)."""

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    linear_dtype: str | None = None
    kv_cache_dtype: str | None = None
    kv_cache_bytes: int = 2**30
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    worker_address: str | None = None  # with TP x PP > 1: where the worker processes connect
    ring_prefix: str | None = None
    wakeup_address: str | None = None
    startup_timeout_s: float = 600.0
    grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES


def build_engine_core(config: InprocConfig):
    """An EngineCore on an InprocExecutor, or on a group of worker processes with TP x PP > 1. This is
    in-process mode's one reach into the engine core (engine/core/setup.py, as the core process builds
    itself), and it imports torch, in the engine thread only."""
    from engine.core.setup import build_engine_core as build
    from engine.core.setup import start_worker_group
    from engine.executor.executor import InprocExecutor
    from engine.model.config import ModelConfig
    from engine.worker.worker import WorkerConfig

    world_size = config.tensor_parallel_size * config.pipeline_parallel_size
    if world_size > 1:
        if not (config.worker_address and config.ring_prefix and config.wakeup_address):
            raise ValueError("in-process mode with TP x PP > 1 needs --worker-address, --ring-prefix and "
                             "--wakeup-address (vsup serve passes them)")
        executor = start_worker_group(config.worker_address, world_size, config.startup_timeout_s,
                                      ring_prefix=config.ring_prefix, wakeup_address=config.wakeup_address)
    else:
        executor = InprocExecutor(WorkerConfig(model=config.model, device=config.device, dtype=config.dtype,
                                               linear_dtype=config.linear_dtype,
                                               kv_cache_dtype=config.kv_cache_dtype,
                                               kv_cache_bytes=config.kv_cache_bytes, block_size=config.block_size,
                                               num_threads=config.num_threads, name="api-server a0"))
    return build(config, executor, ModelConfig.from_pretrained(config.model))


class InprocClient(ClientBase):
    """The engine client's API on an EngineCore stepped by a thread of this process."""

    def __init__(self, config: InprocConfig, build=build_engine_core, on_fatal=None):
        """`on_fatal(error)`, on the event loop, once no core is left in this process (it failed to start, or
        failed later): the API server ends then, for its supervisor to start it, and so a core, again."""
        super().__init__(1)
        self.config = config
        self._build = build
        self._on_fatal = on_fatal
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        """Start the engine thread; the core is ready once it has loaded the model."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Abort what runs, stop the thread, free the core."""
        for stream in list(self.requests.values()):
            self.abort(stream)
        if self._thread is not None:
            self._commands.put(("stop",))
            await asyncio.to_thread(self._thread.join, 30)

    # the API, on the event loop

    def add_request(self, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                    req_id: str | None = None) -> RequestStream:
        """Queue a request for the engine thread; raises EngineUnavailable before the core is ready."""
        stream = RequestStream(req_id or uuid.uuid4().hex, prompt_token_ids, sampling, self.abort)
        self._track(stream, self.ranks.choose())
        stream.num_submissions = 1
        self._commands.put(("add", AddRequest(stream.wire_id, stream.prompt_token_ids, sampling,
                                              arrival_time=stream.arrival_time)))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """End the stream now; the engine thread drops the request at its next look at the queue."""
        if stream.is_finished:
            return
        self._forget(stream)
        self._commands.put(("abort", [stream.wire_id]))
        stream.finish(FinishReason.ABORT)

    async def call_utility(self, method: str, *args, dp_rank: int | None = None, timeout_s: float = 5.0):
        """`get_stats` is the one method the in-process core answers."""
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._commands.put(("utility", call_id, method))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def _on_result(self, call_id: int, result, error: str | None) -> None:
        future = self._calls.get(call_id)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(RuntimeError(error))

    # the engine thread

    def _post(self, fn, *args) -> None:
        self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        try:
            core = self._build(self.config)
        except Exception as e:
            log.exception("in-process engine core failed to start")
            self._post(self._on_failed, f"{type(e).__name__}: {e}")
            return
        self._post(self._on_ready, core.config.max_model_len)
        log.info("ready", num_blocks=core.config.num_blocks, max_model_len=core.config.max_model_len)
        try:
            self._serve(core)
        except Exception as e:
            log.exception("in-process engine core failed")
            self._post(self._on_failed, f"{type(e).__name__}: {e}")
        finally:
            core.close()

    def _on_failed(self, error: str) -> None:
        """No core is left in this process: every open request ends with the error, then `on_fatal`."""
        self.ranks.on_failed(0, error)
        for stream in list(self.requests.values()):
            self._forget(stream)
            stream.finish(FinishReason.ERROR, f"the engine core failed: {error}")
        if self._on_fatal is not None:
            self._on_fatal(error)

    def _on_ready(self, max_model_len: int) -> None:
        self.ranks.on_hello(0, "inproc", None)
        self.ranks.on_ready(0, max_model_len)

    def _serve(self, core) -> None:
        import msgspec

        last_heartbeat = 0.0
        while True:
            busy = core.has_work()
            try:
                command = self._commands.get(block=not busy, timeout=None if busy else HEARTBEAT_S)
            except queue.Empty:
                command = None
            while command is not None:
                kind = command[0]
                if kind == "stop":
                    return
                if kind == "add":
                    refused = core.add_request(command[1])
                    if refused is not None:
                        self._post(self._deliver, 0, [refused], None)
                elif kind == "abort":
                    core.abort_requests(command[1])  # the stream already ended on this side
                elif kind == "utility":
                    result, error = (msgspec.to_builtins(core.stats()), None) if command[2] == "get_stats" else (
                        None, f"unknown utility method {command[2]!r}")
                    self._post(self._on_result, command[1], result, error)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if core.has_work():
                updates = core.step()
                self._post(self._deliver, 0, updates, core.stats())
            elif time.monotonic() - last_heartbeat >= HEARTBEAT_S:
                self._post(self.ranks.heard, 0)
                last_heartbeat = time.monotonic()
