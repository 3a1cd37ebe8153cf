"""The front's own HTTP/1.1 client (vsup/front/upstream.py) against a real Unix socket server that answers as
uvicorn does: chunked answers split anywhere across reads, sized ones, kept connections that the server closed,
answers cut short."""

from __future__ import annotations

import asyncio

import pytest

from vsup.front.upstream import Gone, Pool


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def serving(tmp_path, answer):
    """A server on a Unix socket: `answer(request head, body, writer)` writes each answer; the requests seen."""
    seen = []

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                body = await reader.readexactly(length)
                seen.append((head, body))
                if not await answer(head, body, writer):
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
    path = str(tmp_path / "up.sock")
    server = await asyncio.start_unix_server(handle, path)
    return server, path, seen


def two_requests(tmp_path, answer, body=b"{}", headers=None):
    """Two requests in turn through one Pool to a server that answers with `answer`: each answer's (status,
    headers, body read whole), the requests the server saw, and the connections the pool kept at the end."""
    async def main():
        server, path, seen = await serving(tmp_path, answer)
        async with server:
            pool = Pool(path)
            got = []
            for _ in range(2):
                response = await pool.post("/v1/completions", body, headers or {})
                got.append((response.status_code, response.headers, await response.aread()))
                await response.aclose()
                await asyncio.sleep(0.05)
            kept = len(pool.idle)
            await pool.aclose()
            return got, seen, kept
    return asyncio.run(main())


def test_a_chunked_answer_split_anywhere_reads_whole_and_the_connection_is_kept(tmp_path):
    events = [b'data: {"n":%d}\n\n' % i for i in range(50)]
    wire = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + chunked(*events)

    async def answer(head, body, writer):
        for i in range(0, len(wire), 7):  # 7 bytes a write: sizes, CRLFs and data cut everywhere
            writer.write(wire[i:i + 7])
            await writer.drain()
            await asyncio.sleep(0)
        return True

    got, seen, kept = two_requests(tmp_path, answer, b'{"a":1}', {"authorization": "Bearer k"})
    assert [(status, headers["content-type"], text) for status, headers, text in got] == \
        [(200, "text/event-stream", b"".join(events))] * 2
    assert kept == 1 and len(seen) == 2  # the second request went on the first's connection
    assert seen[0][0].startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"authorization: Bearer k\r\n" in seen[0][0]
    assert seen[0][1] == b'{"a":1}'


def test_a_sized_answer_and_a_kept_connection_the_server_closed(tmp_path):
    async def answer(head, body, writer):
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 9\r\n\r\n"
                     b'{"e":"x"}')
        await writer.drain()
        return False  # and closes the connection, as a server whose keep-alive ran out

    got, seen, _ = two_requests(tmp_path, answer)
    assert [(status, text) for status, _, text in got] == [(400, b'{"e":"x"}')] * 2  # (not Gone: a new one served)
    assert len(seen) == 2


def test_an_answer_cut_short_or_no_server_is_gone(tmp_path):
    async def answer(head, body, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (5, b"hello"))
        await writer.drain()
        return False  # the tree died mid-stream

    async def main():
        server, path, _ = await serving(tmp_path, answer)
        async with server:
            pool = Pool(path)
            response = await pool.post("/v1/completions", b"{}", {})
            pieces = []
            with pytest.raises(Gone, match="ended early"):
                async for piece in response.aiter_raw():
                    pieces.append(piece)
            await response.aclose()
            assert pieces == [b"hello"] and pool.idle == []
        with pytest.raises(Gone, match="cannot connect"):
            await Pool(str(tmp_path / "none.sock")).post("/v1/completions", b"{}", {})
    asyncio.run(main())
