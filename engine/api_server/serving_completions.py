"""POST /v1/completions: one or several prompts (text or token ids), n choices each, streamed or not."""

from __future__ import annotations

import structlog
from fastapi import Request
from fastapi.responses import Response

from engine.api_server.answer import (ClientDisconnected, error_event, json_response, new_request_id, now, open_stream,
                                     run_to_end, sse, streaming_response, usage)
from engine.api_server.errors import bad_request
from engine.api_server.generation import ChoiceDelta, ChoiceResult
from engine.api_server.logprobs import completion_logprobs, prompt_logprobs_list, token_namer
from engine.api_server.openai_models import MAX_N, CompletionRequest, check_token_ids
from engine.api_server.serving import Serving


async def create_completion(body: CompletionRequest, request: Request, serving: Serving) -> Response:
    """Validate, tokenize, start the choices, answer (400/404/503 before anything runs)."""
    model = serving.check_model(body.model)
    serving.check_ready()
    limits = serving.limits()
    prompts, prompt_texts = await _tokenize(body, serving)
    if len(prompts) * body.n > MAX_N:
        raise bad_request(f"at most {MAX_N} choices per request (prompts x n); got {len(prompts) * body.n}", "n")
    params = [body.sampling_params(len(p), limits) for p in prompts]
    request_id = new_request_id("cmpl")
    structlog.contextvars.bind_contextvars(request_id=request_id)  # this request's task only
    runners = serving.start(request_id, prompts, params, body)
    # vLLM echoes no prompt text with return_token_ids (the prompt_token_ids stand for it), only its logprobs
    echo = [prompt_texts[r.index // body.n] if body.echo and not body.return_token_ids else "" for r in runners]
    view = CompletionView(request_id, model, serving, body, echo, [prompts[r.index // body.n] for r in runners])
    num_prompt_tokens = sum(len(p) for p in prompts)
    try:
        if body.stream:
            first, deltas = await open_stream(request, runners)
            return streaming_response(_events(view, first, deltas, num_prompt_tokens), runners)
        results = await run_to_end(request, runners)
    except ClientDisconnected:
        return Response(status_code=499)
    return json_response({
        "id": request_id, "object": "text_completion", "created": now(), "model": model,
        "choices": [view.choice(r) for r in results],
        "usage": usage(num_prompt_tokens, sum(len(r.token_ids) for r in results))})


async def _tokenize(body: CompletionRequest, serving: Serving) -> tuple[list[list[int]], list[str]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("the prompt is empty; send a string or token ids", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    if isinstance(prompt[0], str):
        ids = [await serving.tokenizer.encode_async(text) for text in prompt]
        texts = list(prompt)
    else:
        ids = [list(p) for p in prompt]
        texts = [serving.tokenizer.decode(p) if body.echo else "" for p in ids]
    for p in ids:
        check_token_ids(p, serving.vocab_size, "prompt")
    return ids, texts


class CompletionView:
    """Shapes choices and chunks of one completion."""

    def __init__(self, request_id: str, model: str, serving: Serving, body: CompletionRequest, echo: list[str],
                 prompts: list[list[int]]):
        self.request_id, self.model, self.serving, self.body, self.echo = request_id, model, serving, body, echo
        self.prompts = prompts  # each choice's prompt token ids
        self.is_first = [True] * len(echo)
        self.next_offset = [0] * len(echo)  # where the next token's text starts, counted in the tokens' texts
        self.name = token_namer(serving.tokenizer, body.return_tokens_as_token_ids)

    def choice(self, r: ChoiceResult | ChoiceDelta) -> dict:
        """A whole choice, or a streamed one's chunk; the first of a choice echoes its prompt (`echo`)."""
        is_first, self.is_first[r.index] = self.is_first[r.index], False
        prefix = self.echo[r.index] if is_first else ""
        prompt = self.prompts[r.index]
        logprobs = None
        if self.body.logprobs is not None:
            token_ids, entries = r.token_ids, r.logprobs
            if is_first and self.body.echo:  # the prompt's tokens lead, the first with no logprob
                token_ids = prompt + token_ids
                entries = [None, *(r.prompt_logprobs or [None] * (len(prompt) - 1)), *entries]
            logprobs = completion_logprobs(self.name, token_ids, entries, self.next_offset[r.index])
            if logprobs["tokens"]:  # by the tokens reported, not the text: a stop string's text lags (vLLM's way)
                self.next_offset[r.index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        return_ids = self.body.return_token_ids
        out = {"index": r.index, "text": prefix + r.text, "logprobs": logprobs, "finish_reason": r.finish_reason,
               "stop_reason": r.stop_reason, "prompt_token_ids": prompt if return_ids and is_first else None,
               "token_ids": r.token_ids if return_ids else None}
        if isinstance(r, ChoiceResult):
            out["prompt_logprobs"] = (prompt_logprobs_list(self.serving.tokenizer.token_text, prompt, r.prompt_logprobs)
                                      if r.prompt_logprobs is not None else None)
        return out

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        out = {"id": self.request_id, "object": "text_completion", "created": now(), "model": self.model,
               "choices": choices}
        if self.body.include_usage:
            out["usage"] = usage_
        return out


async def _events(view: CompletionView, first: ChoiceDelta, deltas, num_prompt_tokens: int):
    num_tokens = 0
    try:
        delta = first
        while delta is not None:
            if delta.finish_reason == "error":
                yield error_event(delta)
                break
            num_tokens += len(delta.token_ids)
            if (delta.text or delta.finish_reason or view.body.logprobs is not None or view.body.return_token_ids
                    or view.is_first[delta.index] and view.body.echo):
                yield sse(view.chunk([view.choice(delta)]))  # not for tokens that only began a character
            delta = await anext(deltas, None)
        else:
            if view.body.include_usage:
                yield sse(view.chunk([], usage(num_prompt_tokens, num_tokens)))
        yield sse("[DONE]")
    finally:
        await deltas.aclose()
