"""From one engine request's token updates to text deltas of one choice, and n choices merged.

`ChoiceRunner` detokenizes incrementally, applies stop strings (aborting
the request in its core when one matches), hides the stop token the core
stopped on, and reports latencies to the metrics. Both generation routes
stream its deltas or collect them; `merge` interleaves the n choices (and
the prompts of a batched completion) in arrival order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import structlog

from engine.api_server.detokenizer import IncrementalDetokenizer, StopChecker
from engine.api_server.request_stream import RequestStream
from engine.api_server.tokenizer import Tokenizer
from engine.wire.protocol import FinishReason, RequestUpdate
from engine.wire.scheduler_output import TokenLogprobs

log = structlog.get_logger("api-server")


@dataclass
class ChoiceDelta:
    """What one choice gained: text safe to show, the tokens behind it, and maybe its end."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    prompt_logprobs: list[TokenLogprobs] | None = None  # of prompt tokens 1.., in the first delta


@dataclass
class ChoiceResult:
    """A whole choice, for non-streaming responses."""

    index: int
    num_prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None

    def add(self, delta: ChoiceDelta) -> None:
        """Append one delta of this choice."""
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.error = delta.error or self.error
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason
        self.prompt_logprobs = self.prompt_logprobs if self.prompt_logprobs is not None else delta.prompt_logprobs


class ChoiceRunner:
    """One choice: the updates of its engine request in, ChoiceDeltas out."""

    def __init__(self, index: int, stream: RequestStream, tokenizer: Tokenizer, *, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True, metrics=None):
        self.index = index
        self.stream = stream
        self.detokenizer = IncrementalDetokenizer(
            lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), stream.prompt_token_ids)
        self.stop = StopChecker(stop, include_stop_str_in_output)
        self.include_stop = include_stop_str_in_output
        self.metrics = metrics
        self.num_output_tokens = 0
        self.last_token_time: float | None = None
        self.has_prompt_logprobs = stream.sampling.prompt_logprobs is None  # none asked: none to wait for

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.stream.prompt_token_ids)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """The choice's deltas up to and including the one with its finish_reason; aborts if left early."""
        finish_reason = None
        try:
            async for updates in self.stream:
                delta = self._process(updates)
                finish_reason = delta.finish_reason
                if delta.text or delta.token_ids or finish_reason:
                    yield delta
                if finish_reason:
                    return
        finally:
            self.stream.close()  # a stop string, a client gone: the core stops working on it
            if self.metrics is not None:
                self.metrics.on_finish(self.stream, self.num_output_tokens, finish_reason or "abort")
            log.debug("choice finished", choice=self.index, finish_reason=finish_reason or "abort",
                      num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=self.num_output_tokens,
                      dp_rank=self.stream.dp_rank, num_submissions=self.stream.num_submissions)

    def _process(self, updates: list[RequestUpdate]) -> ChoiceDelta:
        delta = ChoiceDelta(self.index)
        self._on_tokens(sum(len(u.new_token_ids) for u in updates))
        for update in updates:
            if not self.has_prompt_logprobs and update.new_token_ids:  # once (a resubmission brings them again)
                delta.prompt_logprobs, self.has_prompt_logprobs = update.prompt_logprobs, True
            num_new = len(update.new_token_ids)
            for i, token_id in enumerate(update.new_token_ids):
                self.num_output_tokens += 1
                delta.token_ids.append(token_id)
                delta.logprobs.append(update.logprobs[i] if i < len(update.logprobs) else None)
                # the core stopped on this stop token or EOS: count it, do not show it
                hidden = update.finish_reason == FinishReason.STOP and i == num_new - 1 and not self.include_stop
                text, stopped = self.stop.feed("" if hidden else self.detokenizer.add(token_id))
                delta.text += text
                if stopped:
                    delta.finish_reason, delta.stop_reason = "stop", self.stop.stopped_by
                    return delta
            if update.finish_reason is not None:
                text, stopped = self.stop.feed(self.detokenizer.flush(), final=True)
                delta.text += text
                delta.finish_reason = "stop" if stopped else str(update.finish_reason)
                delta.stop_reason = self.stop.stopped_by if stopped else update.stop_reason
                delta.error = update.error
                return delta
        return delta

    def _on_tokens(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = time.time()
        if self.metrics is not None:
            if self.last_token_time is None:
                self.metrics.on_first_token(now - self.stream.arrival_time)
            else:
                self.metrics.on_inter_token(now - self.last_token_time, num_tokens)
        self.last_token_time = now


_DONE = object()


async def merge(iterators: Sequence[AsyncIterator]) -> AsyncIterator:
    """Items of several async iterators in arrival order; leaving early cancels them all."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(iterator):
        try:
            async for item in iterator:
                queue.put_nowait(item)
        except Exception as e:  # handed to the reader, which raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(it)) for it in iterators]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
