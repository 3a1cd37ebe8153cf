"""A plain HTTP GET over a Unix socket, for the supervisor's probes of a stock vLLM (`vllm serve --uds`)."""

from __future__ import annotations

import http.client
import socket


class _Connection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def get(path: str, route: str, timeout: float) -> tuple[int, str]:
    """(status, body) of GET `route` from the HTTP server on Unix socket `path`; OSError if none answers."""
    connection = _Connection(path, timeout)
    try:
        connection.request("GET", route)
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    except http.client.HTTPException as e:
        raise OSError(f"{path}: {e}") from e
    finally:
        connection.close()
