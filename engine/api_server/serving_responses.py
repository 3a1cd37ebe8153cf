"""POST /v1/responses: OpenAI's Responses API over the chat template, whole or streamed as its events
(response.created ... response.output_text.delta ... response.completed). Tool calls are function_call
items, read as on chat completions (engine/api_server/chat_tools.py); with tools, a streamed response's
items come whole once the generation has ended (its text may turn out to be a call)."""

from __future__ import annotations

import time
import uuid

import msgspec
import structlog
from fastapi import Request
from fastapi.responses import Response

from engine.api_server.answer import ClientDisconnected, json_response, open_stream, run_to_end, streaming_response
from engine.api_server.chat_tools import NONE, ChatTools
from engine.api_server.generation import ChoiceResult
from engine.api_server.openai_models import check_token_ids
from engine.api_server.responses_models import ResponsesRequest
from engine.api_server.serving import Serving

_json = msgspec.json.Encoder()


async def create_response(body: ResponsesRequest, request: Request, serving: Serving) -> Response:
    """Validate, render and tokenize the conversation, generate one message, answer."""
    model = serving.check_model(body.model)
    serving.check_ready()
    limits = serving.limits()
    tools = body.template_tools()
    text = serving.tokenizer.apply_chat_template(body.messages(), add_generation_prompt=True,
                                                 **({"tools": tools} if tools else {}))
    prompt = await serving.tokenizer.encode_async(text, add_special_tokens=False)
    check_token_ids(prompt, limits.vocab_size, "input")
    params = body.sampling_params(len(prompt), limits)
    view = ResponseView(model, body, len(prompt))
    structlog.contextvars.bind_contextvars(request_id=view.id)
    runners = serving.start(view.id, [prompt], [params], body)
    try:
        if body.stream:
            first, deltas = await open_stream(request, runners)
            return streaming_response(_events(view, first, deltas), runners)
        (result,) = await run_to_end(request, runners)
    except ClientDisconnected:
        return Response(status_code=499)
    return json_response(view.response(result))


class ResponseView:
    """Shapes the response object and its stream's events."""

    def __init__(self, model: str, body: ResponsesRequest, num_prompt_tokens: int):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.model, self.body, self.num_prompt_tokens = model, body, num_prompt_tokens
        self.created_at = int(time.time())
        self.sequence_number = 0
        self.tools = ChatTools(body.tool_mode(), body.chat_tool_choice())

    def response(self, result: ChoiceResult | None) -> dict:
        """The response object: in progress (no result yet), completed, or incomplete (max_output_tokens)."""
        b = self.body
        if result is None:
            status, output, usage, incomplete = "in_progress", [], None, None
        else:
            cut = result.finish_reason == "length"
            status = "incomplete" if cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut else None
            output = self.output(result.text, result.finish_reason, status)
            n = len(result.token_ids)
            usage = {"input_tokens": self.num_prompt_tokens,
                     "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                              "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                     "output_tokens": n,
                     "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                               "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                     "total_tokens": self.num_prompt_tokens + n}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": incomplete, "instructions": b.instructions,
                "max_output_tokens": b.max_output_tokens, "background": False,
                "temperature": 1.0 if b.temperature is None else b.temperature,
                "top_p": 1.0 if b.top_p is None else b.top_p,
                "presence_penalty": b.presence_penalty, "frequency_penalty": b.frequency_penalty,
                "parallel_tool_calls": b.parallel_tool_calls is not False, "tool_choice": b.tool_choice,
                "tools": b.tools or [],
                "previous_response_id": None, "store": False, "metadata": b.metadata or {},
                "text": {"format": {"type": "text"}}, "truncation": "disabled", "reasoning": None,
                "user": b.user}

    def output(self, text: str, finish_reason: str | None, status: str) -> list[dict]:
        """The output items: the assistant's message, or its text before the calls and one function_call
        item per call."""
        message, _ = self.tools.message(text, finish_reason)
        calls = message.get("tool_calls") or []
        items = [self.message(message["content"], status)] if message["content"] or not calls else []
        return items + [{"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed",
                         "call_id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                        for c in calls]

    def message(self, text: str, status: str) -> dict:
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant",
                "content": [self.part(text)] if status != "in_progress" else []}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def event(self, kind: str, **fields) -> bytes:
        """One SSE event: its type on the `event:` line and in the data, with the stream's sequence number."""
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(data) + b"\n\n"

    def text_event(self, kind: str, **fields) -> bytes:
        return self.event(kind, item_id=self.message_id, output_index=0, content_index=0, **fields)


async def _events(view: ResponseView, first, deltas):
    result = ChoiceResult(0, view.num_prompt_tokens)
    whole = view.tools.mode != NONE  # the text may turn out to be a call: items once it has ended
    try:
        yield view.event("response.created", response=view.response(None))
        yield view.event("response.in_progress", response=view.response(None))
        if not whole:
            yield view.event("response.output_item.added", output_index=0, item=view.message("", "in_progress"))
            yield view.text_event("response.content_part.added", part=view.part(""))
        delta = first
        while delta is not None:
            if delta.finish_reason == "error":
                yield view.event("error", code="server_error", message=f"generation failed: {delta.error}",
                                 param=None)
                return
            result.add(delta)
            if delta.text and not whole:
                yield view.text_event("response.output_text.delta", delta=delta.text, logprobs=[])
            delta = await anext(deltas, None)
        done = view.response(result)
        for index, item in enumerate(done["output"]):
            for event in _item_events(view, index, item, opened=not whole):
                yield event
        # (also when cut by max_output_tokens, with status "incomplete" inside, as vLLM does: the openai
        # client's stream helper ends only on this event)
        yield view.event("response.completed", response=done)
    finally:
        await deltas.aclose()


def _item_events(view: ResponseView, index: int, item: dict, opened: bool):
    """The events of one finished output item; `opened`: the message whose text already streamed."""
    if item["type"] == "function_call":
        yield view.event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                 "status": "in_progress"})
        yield view.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                         delta=item["arguments"])
        yield view.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                         name=item["name"], arguments=item["arguments"])
        yield view.event("response.output_item.done", output_index=index, item=item)
        return
    text = item["content"][0]["text"]
    fields = dict(item_id=item["id"], output_index=index, content_index=0)
    if not opened:
        yield view.event("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                                 "content": []})
        yield view.event("response.content_part.added", part=view.part(""), **fields)
        if text:
            yield view.event("response.output_text.delta", delta=text, logprobs=[], **fields)
    yield view.event("response.output_text.done", text=text, logprobs=[], **fields)
    yield view.event("response.content_part.done", part=view.part(text), **fields)
    yield view.event("response.output_item.done", output_index=index, item=item)
