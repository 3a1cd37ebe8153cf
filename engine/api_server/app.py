"""The FastAPI app: the routes of routes.py around one `Serving` (engine client, tokenizer, limits),
so tests can build one around any client."""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI, Request

from engine.api_server import routes
from engine.api_server.errors import error_response, install_error_handlers
from engine.api_server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from engine.api_server.serving import Serving
from engine.api_server.tokenizer import TokenizerError
from engine.api_server.version import version
from engine.load import measure_event_loop, report_to_supervisor

DEFAULT_MAX_BODY_BYTES = 8 << 20


def build_app(serving: Serving, *, metrics=None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_server_rank: int = 0,
              state_file: str | None = None, before_serving=None) -> FastAPI:
    """The app around `serving`; its lifespan starts and closes the engine client. `state_file`: the
    supervisor's state.json, for the ranks it gave up on; `before_serving(client)`: awaited once the
    client has started, before the server takes connections."""
    app = FastAPI(title="vsup API server", version=version(),
                  lifespan=_lifespan(serving, metrics, before_serving))
    app.state.serving, app.state.metrics = serving, metrics
    app.state.api_server_rank, app.state.state_file, app.state.created = api_server_rank, state_file, int(time.time())
    install_error_handlers(app)
    app.add_exception_handler(TokenizerError, _tokenizer_error)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    for router in (routes.openai, routes.vllm_extras, routes.operations):
        app.include_router(router)
    return app


def _lifespan(serving: Serving, metrics, before_serving):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if metrics is not None:
            serving.client.on_restart = metrics.record_restart
        measure_event_loop(serving.meter, asyncio.get_running_loop())
        report_to_supervisor(serving.meter, lambda: {"num_requests": len(serving.client.requests)})
        await serving.client.start()
        try:
            if before_serving is not None:
                await before_serving(serving.client)
            yield
        finally:
            await serving.client.close()
    return lifespan


async def _tokenizer_error(request: Request, exc: TokenizerError):
    return error_response(400, str(exc))
