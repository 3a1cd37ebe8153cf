"""POST /v1/chat/completions: messages through the model's chat template, n choices, streamed or not,
with tool calls (engine/api_server/chat_tools.py)."""

from __future__ import annotations

import structlog
from fastapi import Request
from fastapi.responses import Response

from engine.api_server.chat_tools import ChatTools, template_message
from engine.api_server.answer import (ClientDisconnected, error_event, json_response, new_request_id, now, open_stream,
                                     run_to_end, sse, streaming_response, usage)
from engine.api_server.errors import bad_request
from engine.api_server.generation import ChoiceDelta, ChoiceResult
from engine.api_server.logprobs import chat_logprobs, prompt_logprobs_list, token_namer
from engine.api_server.openai_models import ChatCompletionRequest, ChatMessage, check_token_ids
from engine.api_server.serving import Serving
from engine.api_server.tokenizer import Tokenizer

# template variables a request's chat_template_kwargs may not override
RESERVED_TEMPLATE_VARS = {"messages", "add_generation_prompt", "bos_token", "eos_token", "pad_token", "unk_token"}


async def create_chat_completion(body: ChatCompletionRequest, request: Request, serving: Serving) -> Response:
    """Validate, render and tokenize the conversation, start the choices, answer."""
    model = serving.check_model(body.model)
    serving.check_ready()
    limits = serving.limits()
    prompt = await serving.tokenizer.encode_async(render_messages(serving.tokenizer, body), add_special_tokens=False)
    check_token_ids(prompt, limits.vocab_size, "messages")
    params = body.sampling_params(len(prompt), limits)
    request_id = new_request_id("chatcmpl")
    structlog.contextvars.bind_contextvars(request_id=request_id)  # this request's task only
    runners = serving.start(request_id, [prompt], [params], body)
    view = ChatView(request_id, model, serving.tokenizer, body, prompt)
    try:
        if body.stream:
            first, deltas = await open_stream(request, runners)
            return streaming_response(_events(view, first, deltas, len(prompt)), runners)
        results = await run_to_end(request, runners)
    except ClientDisconnected:
        return Response(status_code=499)
    return json_response({
        "id": request_id, "object": "chat.completion", "created": now(), "model": model,
        "choices": [view.choice(r) for r in results],
        "usage": usage(len(prompt), sum(len(r.token_ids) for r in results)),
        "prompt_logprobs": view.prompt_logprobs(results[0]),
        "prompt_token_ids": prompt if body.return_token_ids else None})


def render_messages(tokenizer: Tokenizer, body) -> str:
    """The prompt text of `body.messages` (chat requests and /tokenize), via the chat template."""
    kwargs = {k: v for k, v in (getattr(body, "chat_template_kwargs", None) or {}).items()
              if k not in RESERVED_TEMPLATE_VARS and isinstance(k, str) and k.isidentifier()}
    tools = body.template_tools() if isinstance(body, ChatCompletionRequest) else None
    if tools:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template([_message(m) for m in body.messages],
                                         add_generation_prompt=body.add_generation_prompt, **kwargs)


def _message(m: ChatMessage) -> dict:
    if isinstance(m.content, list):
        other = [p.type for p in m.content if p.type != "text"]
        if other:
            raise bad_request(f"only text content parts are supported, got {other[0]!r}", "messages")
        content = "\n".join(p.text or "" for p in m.content)
    else:
        content = m.content or ""
    out = {"role": m.role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = m.tool_calls
    return template_message(out)


class ChatView:
    """Shapes choices and chunks of one chat completion."""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, body: ChatCompletionRequest,
                 prompt: list[int]):
        self.request_id, self.model, self.tokenizer, self.body, self.prompt = request_id, model, tokenizer, body, prompt
        self.include_usage = body.include_usage
        self.num_top = body.top_logprobs or 0
        self.name = token_namer(tokenizer, body.return_tokens_as_token_ids)
        self.tools = ChatTools(body.tool_mode(), body.chat_tool_choice())

    def logprobs(self, r: ChoiceResult | ChoiceDelta) -> dict | None:
        if not self.body.logprobs:
            return None
        return {"content": chat_logprobs(self.name, r.token_ids, r.logprobs, self.num_top)}

    def prompt_logprobs(self, r: ChoiceResult) -> list[dict | None] | None:
        """vLLM's response-level prompt_logprobs (one prompt: the first choice's)."""
        if r.prompt_logprobs is None:
            return None
        return prompt_logprobs_list(self.tokenizer.token_text, self.prompt, r.prompt_logprobs)

    def choice(self, r: ChoiceResult) -> dict:
        message, finish_reason = self.tools.message(r.text, r.finish_reason)
        return {"index": r.index, "message": message,
                "logprobs": self.logprobs(r), "finish_reason": finish_reason, "stop_reason": r.stop_reason,
                "token_ids": r.token_ids if self.body.return_token_ids else None}

    def chunk(self, choices: list[dict], usage_: dict | None = None, **extra) -> bytes:
        out = {"id": self.request_id, "object": "chat.completion.chunk", "created": now(), "model": self.model,
               "choices": choices, **extra}
        if self.include_usage:
            out["usage"] = usage_
        return sse(out)

    def role_chunk(self, index: int) -> bytes:
        """OpenAI opens each choice with the role alone; vLLM's return_token_ids adds the prompt's ids."""
        extra = {"prompt_token_ids": self.prompt} if self.body.return_token_ids else {}
        return self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}], **extra)

    def delta_choice(self, d: ChoiceDelta) -> dict | None:
        """The chunk's choice; None when it has nothing to say yet (a tool call's text held back)."""
        delta = self.tools.delta(d.index, d.text, d.finish_reason)
        if not delta and d.finish_reason is None:
            if not self.body.logprobs and not self.body.return_token_ids:
                return None
            delta = {"content": ""}  # the tokens' logprobs or ids, their text still to come
        out = {"index": d.index, "delta": delta, "logprobs": self.logprobs(d),
               "finish_reason": self.tools.finish_reason(d.index, d.finish_reason)}
        if d.finish_reason:
            out["stop_reason"] = d.stop_reason
        if self.body.return_token_ids:
            out["token_ids"] = d.token_ids
        return out


async def _events(view: ChatView, first: ChoiceDelta, deltas, num_prompt_tokens: int):
    num_tokens = 0
    started: set[int] = set()
    try:
        delta = first
        while delta is not None:
            if delta.finish_reason == "error":
                yield error_event(delta)
                break
            if delta.index not in started:
                started.add(delta.index)
                yield view.role_chunk(delta.index)
            num_tokens += len(delta.token_ids)
            choice = view.delta_choice(delta)  # None for tokens that only began a character, or a call held back
            if choice is not None:
                yield view.chunk([choice])
            delta = await anext(deltas, None)
        else:
            if view.include_usage:
                yield view.chunk([], usage(num_prompt_tokens, num_tokens))
        yield sse("[DONE]")
    finally:
        await deltas.aclose()
