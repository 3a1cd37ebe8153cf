"""The FastAPI app: the OpenAI routes, tokenize/detokenize, health, metrics and version.

`build_app` takes everything it serves with (a `Serving`: engine client,
tokenizer, limits), so tests can build one around any client.
"""

from __future__ import annotations

import contextlib
import time
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.api_server import supervisor_state
from engine.api_server.errors import OpenAIError, bad_request, error_response, install_error_handlers
from engine.api_server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from engine.api_server.openai_models import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                             TokenizeRequest)
from engine.api_server.sampling import check_token_ids
from engine.api_server.serving import Serving, json_response
from engine.api_server.serving_chat import create_chat_completion, render_messages
from engine.api_server.serving_completions import create_completion
from engine.api_server.tokenizer import TokenizerError

DEFAULT_MAX_BODY_BYTES = 8 << 20


def version() -> str:
    """vsup's installed version (the API server reads the package metadata, not vsup's code)."""
    try:
        return metadata.version("vsup")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_app(serving: Serving, *, metrics=None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_server_rank: int = 0,
              state_file: str | None = None, before_serving=None) -> FastAPI:
    """The app around `serving`; its lifespan starts and closes the engine client. `state_file`: the
    supervisor's state.json, for the ranks it gave up on; `before_serving(client)`: awaited once the
    client has started, before the server takes connections."""
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if metrics is not None:
            serving.client.on_restart = metrics.record_restart
        await serving.client.start()
        try:
            if before_serving is not None:
                await before_serving(serving.client)
            yield
        finally:
            await serving.client.close()

    app = FastAPI(title="vsup API server", version=version(), lifespan=lifespan)
    install_error_handlers(app)

    @app.exception_handler(TokenizerError)
    async def _tokenizer_error(request: Request, exc: TokenizerError):
        return error_response(400, str(exc))

    app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)

    # OpenAI

    @app.get("/v1/models")
    async def list_models():
        """The served model names (OpenAI's model list)."""
        return {"object": "list", "data": [_model_card(name, serving, created) for name in serving.served_model_names]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        """One served model, 404 for any other name."""
        serving.check_model(model)
        return _model_card(model, serving, created)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI completions: text or token-id prompts, streamed over SSE or whole."""
        return await create_completion(body, request, serving)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions through the model's chat template, streamed over SSE or whole."""
        return await create_chat_completion(body, request, serving)

    # vLLM's extras

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """Token ids of a prompt, or of chat messages rendered through the chat template (vLLM's route)."""
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
        return {"count": len(tokens), "max_model_len": _max_model_len(serving), "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """The text of token ids (vLLM's route)."""
        serving.check_model(body.model)
        check_token_ids(body.tokens, serving.vocab_size, "tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

    # operations

    @app.get("/health")
    async def health():
        """200 while at least one DP rank is up, else 503; the body says which ranks are up, down, failed."""
        for dp_rank, why in supervisor_state.failed_ranks(supervisor_state.read(state_file)).items():
            serving.client.ranks.on_failed(dp_rank, why)
        body = {**serving.client.health(), "api_server_rank": api_server_rank}
        return JSONResponse(body, status_code=200 if body["up"] else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        """Prometheus exposition: latencies, tokens, the cores' load and KV cache use, restarts."""
        if metrics is None:
            raise OpenAIError(404, "metrics are off")
        return Response(await metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def get_version():
        """vsup's version."""
        return json_response({"version": version()})

    return app


def _max_model_len(serving: Serving) -> int | None:
    try:
        return serving.max_model_len()
    except OpenAIError:
        return None


def _model_card(name: str, serving: Serving, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "vsup",
            "max_model_len": _max_model_len(serving)}
