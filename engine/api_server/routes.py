"""The routes: OpenAI's, vLLM's extras, and operations. Each reads what it serves with from the app's
state (`serving`, `metrics`, ...), which `build_app` sets."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.api_server import supervisor_state
from engine.api_server.answer import json_response
from engine.api_server.errors import OpenAIError, bad_request
from engine.api_server.openai_models import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                             TokenizeRequest, check_token_ids)
from engine.api_server.responses_models import ResponsesRequest
from engine.api_server.serving import Serving
from engine.api_server.serving_chat import create_chat_completion, render_messages
from engine.api_server.serving_completions import create_completion
from engine.api_server.serving_responses import create_response
from engine.api_server.version import version

openai = APIRouter()
vllm_extras = APIRouter()
operations = APIRouter()


def serving_of(request: Request) -> Serving:
    return request.app.state.serving


# OpenAI

@openai.get("/v1/models")
async def list_models(request: Request):
    """The served model names (OpenAI's model list)."""
    serving = serving_of(request)
    return {"object": "list", "data": [model_card(request, name) for name in serving.served_model_names]}


@openai.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request):
    """One served model, 404 for any other name."""
    serving_of(request).check_model(model)
    return model_card(request, model)


@openai.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI completions: text or token-id prompts, streamed over SSE or whole."""
    return await create_completion(body, request, serving_of(request))


@openai.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI chat completions through the model's chat template, streamed over SSE or whole."""
    return await create_chat_completion(body, request, serving_of(request))


@openai.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API: one assistant message for a conversation, whole or as its stream of events."""
    return await create_response(body, request, serving_of(request))


def model_card(request: Request, name: str) -> dict:
    return {"id": name, "object": "model", "created": request.app.state.created, "owned_by": "vsup",
            "max_model_len": max_model_len(serving_of(request))}


def max_model_len(serving: Serving) -> int | None:
    try:
        return serving.max_model_len()
    except OpenAIError:
        return None


# vLLM's extras

@vllm_extras.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    """Token ids of a prompt, or of chat messages rendered through the chat template (vLLM's route)."""
    serving = serving_of(request)
    serving.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages is empty", "messages")
        text, add_special = render_messages(serving.tokenizer, body), False
    else:
        text, add_special = body.prompt, body.add_special_tokens
    tokens = await serving.tokenizer.encode_async(text, add_special_tokens=add_special)
    # through msgspec: FastAPI's own encoder walks a long list of ints one by one on the event loop
    token_strs = serving.tokenizer.token_strs(tokens) if body.return_token_strs else None
    return json_response({"count": len(tokens), "max_model_len": max_model_len(serving), "tokens": tokens,
                          "token_strs": token_strs})


@vllm_extras.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    """The text of token ids (vLLM's route)."""
    serving = serving_of(request)
    serving.check_model(body.model)
    check_token_ids(body.tokens, serving.vocab_size, "tokens")
    return {"prompt": serving.tokenizer.decode(body.tokens)}


# operations

@operations.get("/health")
async def health(request: Request):
    """200 while at least one DP rank is up, else 503; the body says which ranks are up, down, failed."""
    client, state = serving_of(request).client, request.app.state
    supervisor = supervisor_state.read(state.state_file)
    for dp_rank, why in supervisor_state.failed_ranks(supervisor).items():
        client.ranks.on_failed(dp_rank, why)
    body = hung(client.health(), supervisor_state.hung_ranks(supervisor))
    body["api_server_rank"] = state.api_server_rank
    return JSONResponse(body, status_code=200 if body["up"] else 503)


def hung(body: dict, ranks: dict[int, str]) -> dict:
    """/health's body with the ranks that vsup restarts after a hang counted down (the engine core still
    takes requests meanwhile, and keeps them, but a load balancer should send them elsewhere)."""
    ranks = {r: why for r, why in ranks.items() if r in body["up"]}
    if not ranks:
        return body
    up = [r for r in body["up"] if r not in ranks]
    down = sorted([*body["down"], *ranks])
    said = [m for m in (body.get("message") or "").split(", ") if m] + [f"dp{r} hung" for r in sorted(ranks)]
    return {**body, "up": up, "down": down, "status": "degraded" if up else "unavailable", "message": ", ".join(said)}


@operations.get("/metrics")
async def prometheus_metrics(request: Request):
    """Prometheus exposition: latencies, tokens, the cores' load and KV cache use, restarts."""
    metrics = request.app.state.metrics
    if metrics is None:
        raise OpenAIError(404, "metrics are off")
    return Response(await metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@operations.get("/version")
async def get_version():
    """vsup's version."""
    return json_response({"version": version()})
