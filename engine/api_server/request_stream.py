"""`RequestStream`: one request's updates as they arrive from its engine core.

Both engine clients (ZeroMQ and in-process) hand these out. The stream
remembers every token it was given, which is what a resubmission to a
replacement core carries; closing it before its end aborts the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from engine.wire.protocol import FinishReason, RequestUpdate
from engine.wire.sampling_params import SamplingParams


class RequestStream:
    """The updates of one request, in order, batched as they pile up.

    `async for updates in stream` yields lists of RequestUpdate until the
    one that carries a finish_reason. `output_token_ids` holds every token
    received so far; `dp_rank` and `wire_id` say where the request runs now
    (the wire id changes when it is resubmitted, so a dead core's late
    outputs can never be mistaken for the new one's).
    """

    def __init__(self, req_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                 abort: Callable[[RequestStream], None]):
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.arrival_time = time.time()
        self.output_token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.dp_rank: int | None = None
        self.wire_id = req_id
        self.num_submissions = 0
        self._abort = abort
        self._queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        self._is_drained = False

    @property
    def is_finished(self) -> bool:
        """Whether the last update has arrived (or the request was aborted here)."""
        return self.finish_reason is not None

    def put(self, update: RequestUpdate) -> None:
        """Deliver an update (on the event loop's thread); nothing after the finishing one."""
        if self.is_finished:
            return
        self.output_token_ids.extend(update.new_token_ids)
        if update.finish_reason is not None:
            self.finish_reason, self.error = update.finish_reason, update.error
        self._queue.put_nowait(update)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """End the stream from this side (abort, or no core left to run it)."""
        self.put(RequestUpdate(self.req_id, finish_reason=reason, error=error))

    async def get(self) -> list[RequestUpdate]:
        """Wait for the next updates and take all that arrived; [] after the finishing one."""
        if self._is_drained:
            return []
        updates = [await self._queue.get()]
        while not self._queue.empty():
            updates.append(self._queue.get_nowait())
        if updates[-1].finish_reason is not None:
            self._is_drained = True
        return updates

    def close(self) -> None:
        """Abort the request in its engine core unless it already finished."""
        if not self.is_finished:
            self._abort(self)

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[RequestUpdate]:
        updates = await self.get()
        if not updates:
            raise StopAsyncIteration
        return updates

    def __repr__(self) -> str:
        return (f"RequestStream({self.req_id!r}, dp{self.dp_rank}, outputs={len(self.output_token_ids)}, "
                f"finish={self.finish_reason})")

