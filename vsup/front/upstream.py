"""The front's own HTTP/1.1 client for the generations it relays: a POST of JSON to a tree's Unix socket, its
answer read as it comes, on connections kept alive between requests.

It is the relay's hot path: at a GPU's rate vLLM sends thousands of chunks a second, and httpx (h11 and anyio
under it) spent more on each than the rest of the front together (bench/front_relay.py). This reads with
asyncio's streams and takes every whole chunk of a read at once. What the relay needs of httpx's response it
has (status_code, headers, aiter_raw, aread, aclose); a socket that refuses, resets or ends an answer early
raises Gone, an httpx.TransportError, as httpx would. The other routes keep httpx.
"""

from __future__ import annotations

import asyncio
import time

import httpx

IDLE_S = 2.0  # a kept connection older than this is not reused (vLLM's uvicorn closes them after 5 s)
MAX_IDLE = 512
HEAD_LIMIT = 64 * 1024
READ = 64 * 1024


class Gone(httpx.TransportError):
    """The tree's socket refused the connection, reset it, or ended an answer early."""


class Response:
    def __init__(self, pool: Pool, conn: tuple, status_code: int, headers: dict[str, str]):
        self.pool, self.conn, self.status_code, self.headers = pool, conn, status_code, headers
        self.chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        length = headers.get("content-length")
        self.left = int(length) if length is not None and not self.chunked else None
        self.complete = False

    async def aiter_raw(self):
        """The body as it comes: each piece every whole chunk that one read of the socket brought."""
        reader = self.conn[0]
        if not self.chunked:
            while self.left is None or self.left > 0:
                data = await self._read(reader, READ if self.left is None else min(READ, self.left))
                if not data:
                    if self.left is None:  # (a body that the connection's end ends)
                        self.complete = True
                        return
                    raise Gone("the answer ended early")
                if self.left is not None:
                    self.left -= len(data)
                yield data
            self.complete = True
            return
        buffer = bytearray()
        while True:
            out, end = bytearray(), False
            while (line := buffer.find(b"\r\n")) >= 0:
                try:
                    size = int(bytes(buffer[:line]).split(b";")[0], 16)
                except ValueError:
                    raise Gone("a malformed chunk") from None
                if size == 0:
                    if len(buffer) < line + 4:  # (the last chunk's CRLF, no trailers)
                        break
                    del buffer[:line + 4]
                    end = True
                    break
                if len(buffer) < line + 2 + size + 2:
                    break
                out += buffer[line + 2:line + 2 + size]
                del buffer[:line + 2 + size + 2]
            if out:
                yield bytes(out)
            if end:
                self.complete = True
                return
            data = await self._read(reader, READ)
            if not data:
                raise Gone("the answer ended early")
            buffer += data

    @staticmethod
    async def _read(reader: asyncio.StreamReader, n: int) -> bytes:
        try:
            return await reader.read(n)
        except OSError as e:
            raise Gone(f"the connection broke: {e}") from e

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self.aiter_raw()])

    async def aclose(self) -> None:
        """Give the connection back if the answer was read whole, else close it (vLLM aborts the request)."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        if self.complete and self.headers.get("connection", "").lower() != "close":
            self.pool.give_back(conn)
        else:
            conn[1].close()


class Pool:
    """Connections to one Unix socket, kept alive between requests."""

    def __init__(self, path: str):
        self.path = path
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []

    async def post(self, route: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send the request and read the answer's head; Gone if the socket refuses or drops it. A kept
        connection that the server closed meanwhile is dropped for the next, and at last a new one."""
        head = (f"POST {route} HTTP/1.1\r\nhost: vllm\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() not in ("content-type", "host"))
                + "\r\n").encode("latin-1") + body
        while True:
            conn, reused = self._take()
            if conn is None:
                try:
                    conn = await asyncio.open_unix_connection(self.path, limit=HEAD_LIMIT)
                except OSError as e:
                    raise Gone(f"cannot connect to {self.path}: {e}") from e
            reader, writer = conn
            try:
                writer.write(head)
                raw = await reader.readuntil(b"\r\n\r\n")
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
                writer.close()
                if reused:
                    continue
                raise Gone(f"no answer: {e}") from e
            return Response(self, conn, *_head(raw))

    def _take(self):
        now = time.monotonic()
        while self.idle:
            reader, writer, since = self.idle.pop()
            if now - since < IDLE_S and not reader.at_eof() and not writer.is_closing():
                return (reader, writer), True
            writer.close()
        return None, False

    def give_back(self, conn: tuple) -> None:
        if len(self.idle) < MAX_IDLE:
            self.idle.append((*conn, time.monotonic()))
        else:
            conn[1].close()

    async def aclose(self) -> None:
        for _, writer, _ in self.idle:
            writer.close()
        self.idle = []


def _head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        raise Gone(f"not an HTTP answer: {lines[0][:80]!r}") from None
    headers = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
    return status, headers
