"""The front's own errors, in the OpenAI shape that the engine's API server answers too
(engine/api_server/errors.py; tests/test_contracts.py holds the two equal, as neither imports the other), and
what ends a generation: a `Failure`, its status for a whole response and its body for a stream's error event.

    {"error": {"message": "...", "type": "server_error", "param": null, "code": null}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": {...}}` with OpenAI's type for the status."""
    kind = "server_error" if status_code >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status_code: int, message: str, retry_after: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return JSONResponse(error_body(status_code, message), status_code=status_code, headers=headers)


class Refused(Exception):
    """A request the front gives up on, with the status and message the client gets."""

    def __init__(self, status: int, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.retry_after)

    def failure(self) -> Failure:
        return Failure(self.status, error_body(self.status, self.message))


@dataclass(frozen=True)
class Failure:
    """What ends a generation with an error: the status a whole response gets, the body a stream's last
    event carries (vLLM's own, or the front's)."""

    status: int
    body: dict

    @classmethod
    def of(cls, response: Response) -> Failure:
        """What vLLM answered instead of a stream, once the stream had begun."""
        try:
            body = json.loads(response.body)
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return cls(response.status_code, body)
        return cls(response.status_code, error_body(response.status_code, response.body.decode(errors="replace")))
