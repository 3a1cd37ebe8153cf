"""How a generation request is answered: whole (`run_to_end`) or streamed over SSE (`open_stream`,
`streaming_response`), the pieces of OpenAI's bodies, and what a client that goes away ends."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from engine.api_server.errors import OpenAIError, error_body
from engine.api_server.generation import ChoiceDelta, ChoiceResult, ChoiceRunner, merge

_json = msgspec.json.Encoder()


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


def new_request_id(prefix: str) -> str:
    """`cmpl-<hex>` / `chatcmpl-<hex>`: unique across API servers, as the cores require."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    """OpenAI's usage object."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def json_response(body: dict, status_code: int = 200) -> Response:
    """JSON through msgspec (faster than the stdlib for every response)."""
    return Response(_json.encode(body), status_code=status_code, media_type="application/json")


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data.encode() if isinstance(data, str) else _json.encode(data)
    return b"data: " + payload + b"\n\n"


def error_event(delta: ChoiceDelta) -> bytes:
    """A stream's error once 200 was sent: an SSE event with the OpenAI error body."""
    return sse(error_body(500, f"generation failed: {delta.error or delta.finish_reason}"))


def error_status(num_tokens: int) -> int:
    """A core refuses a request before any token only for its shape (too big for its cache): 400."""
    return 400 if num_tokens == 0 else 500


def close_all(runners: Sequence[ChoiceRunner]) -> None:
    """Abort whatever of these choices still runs (idempotent); every route ends with it."""
    for runner in runners:
        runner.stream.close()


async def until_disconnected(request: Request, awaitable: Awaitable):
    """Await `awaitable` unless the HTTP client disconnects first; then cancel it, raise ClientDisconnected."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_to_end(request: Request, runners: Sequence[ChoiceRunner]) -> list[ChoiceResult]:
    """Every choice, whole (non-streaming). Raises ClientDisconnected, or OpenAIError if one failed."""
    try:
        results = await until_disconnected(request, _collect(runners))
    finally:
        close_all(runners)
    failed = [r for r in results if r.finish_reason == "error"]
    if failed:
        num_tokens = sum(len(r.token_ids) for r in results)
        raise OpenAIError(error_status(num_tokens), failed[0].error or "generation failed")
    return results


async def _collect(runners: Sequence[ChoiceRunner]) -> list[ChoiceResult]:
    results = [ChoiceResult(r.index, r.num_prompt_tokens) for r in runners]
    async for delta in merge([r.deltas() for r in runners]):
        results[delta.index].add(delta)
    return results


async def open_stream(request: Request, runners: Sequence[ChoiceRunner]) -> tuple[ChoiceDelta, AsyncIterator]:
    """The choices' first delta and the rest. Waiting for the first lets a request the core
    refuses still get its status code; raises ClientDisconnected or OpenAIError."""
    deltas = merge([r.deltas() for r in runners])
    try:
        first = await until_disconnected(request, anext(deltas))
        if first.finish_reason == "error":
            await deltas.aclose()
            raise OpenAIError(error_status(len(first.token_ids)), first.error or "generation failed")
    except BaseException:
        close_all(runners)
        raise
    return first, deltas


def streaming_response(events: AsyncIterator[bytes], runners: Sequence[ChoiceRunner]) -> StreamingResponse:
    """SSE; whatever way the response ends (a client gone before it started too), the choices end."""
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(close_all, runners))
