"""Every error the API server returns, in OpenAI's JSON shape, whatever raised it.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

The official client maps the status to its exception classes (400
BadRequestError, 401 AuthenticationError, 404 NotFoundError, 5xx
InternalServerError), so the status and body must agree everywhere,
including on FastAPI's own validation errors and unknown routes.
"""

from __future__ import annotations

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = structlog.get_logger("api-server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error"}


class OpenAIError(Exception):
    """An error with its HTTP status, as the client should see it."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """400: the request itself is wrong; `param` names the field."""
    return OpenAIError(400, message, param=param)


def model_not_found(name: str | None) -> OpenAIError:
    """404: a model this server does not serve."""
    return OpenAIError(404, f"The model {name!r} does not exist.", param="model", code="model_not_found")


def unavailable(message: str) -> OpenAIError:
    """503: no engine core can take the request now."""
    return OpenAIError(503, message, code="engine_unavailable")


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": {...}}` with OpenAI's type for the status."""
    kind = _TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status_code: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """The error body as a response with its status."""
    return JSONResponse(error_body(status_code, message, param, code), status_code=status_code, headers=headers)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable sentence from pydantic's errors, and the parameter it names."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', message)}", None
    more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return (f"{where}: {message}{more}" if where else f"{message}{more}"), param


def install_error_handlers(app: FastAPI) -> None:
    """Make FastAPI's and Starlette's errors, and any bug, answer in OpenAI's format."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return error_response(exc.status_code, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("unhandled error", path=request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")
