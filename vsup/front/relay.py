"""The relay of a generation: sent to a tree, its chunks passed on as they come, and, when the tree dies
under it, held until another is up and resumed there from its token IDs (resume.py), so that the client
sees a pause and no error. What vLLM itself rejects (4xx) passes through unchanged and is never retried.

A stream that gets nothing for --keepalive seconds (a tree restarting can take
minutes) is sent an SSE comment, which clients ignore: a client's read timeout,
or a proxy's, never cuts a stream that the front is holding. A stream held
before its first answer is begun then (200, text/event-stream), and what vLLM
answers after is sent in it, an error as an error event.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import msgspec
from starlette.responses import JSONResponse, Response, StreamingResponse

from vsup.front.errors import Failure, Refused, error_body
from vsup.front.log import log
from vsup.front.resume import DONE, Generation, charge, sse, sse_events, stream_error
from vsup.front.routing import Router
from vsup.front.upstream import Pool

REWIND_MAX = 16  # tokens a resume looks back for text that vLLM held back
KEEPALIVE = b": keep-alive\n\n"


class Relay:
    def __init__(self, router: Router, max_resumes: int, keepalive: float):
        self.router, self.max_resumes, self.keepalive = router, max_resumes, keepalive
        self.clients: list[httpx.AsyncClient] = []  # one per replica, made at the app's start: all but generations
        self.pools: list[Pool] = []  # one per replica: the generations (upstream.py)
        self.probe = asyncio.Lock()  # a request that may have killed the tree runs alone until a token comes out
        self.probing: dict[int, Generation] = {}  # tree gen -> the request probing it
        self.resumed_total = 0

    async def generate(self, g: Generation, headers: dict) -> Response:
        submitting = asyncio.ensure_future(self._submit(g, headers, g.dead))
        if g.streams:  # begun at once if the answer takes --keepalive seconds (no tree up, say)
            await asyncio.wait({submitting}, timeout=self.keepalive)
            if not submitting.done():
                return self._streamed(g, headers, submitting)
        try:
            opened = await submitting
        except Refused as e:
            opened = e.response()
        if isinstance(opened, Response):
            self.router.bound.pop(id(g), None)  # (it counts in the load of a tree while it runs there)
            return opened
        if g.streams:
            return self._streamed(g, headers, submitting)
        failure = None
        async with contextlib.aclosing(self._chunks(g, headers, opened)) as chunks:
            async for chunk in chunks:
                if isinstance(chunk, Failure):
                    failure = chunk
        if failure is not None:
            return JSONResponse(failure.body, status_code=failure.status)
        return JSONResponse(g.response())

    def _streamed(self, g: Generation, headers: dict, submitting: asyncio.Future) -> Streamed:
        return Streamed(self._stream(g, headers, submitting), media_type="text/event-stream",
                        headers={"x-accel-buffering": "no"}, keepalive=self.keepalive)

    async def _stream(self, g: Generation, headers: dict, submitting: asyncio.Future):
        async with contextlib.aclosing(self._submitted(g, headers, submitting)) as chunks:  # closed if the client left
            async for chunk in chunks:
                yield sse(chunk.body if isinstance(chunk, Failure) else chunk)
        yield DONE

    async def _submitted(self, g: Generation, headers: dict, submitting: asyncio.Future):
        """The chunks of a streamed generation whose submission may still be under way; a Failure ends them."""
        try:
            opened = await submitting
        except Refused as e:
            yield e.failure()
            return
        if isinstance(opened, Response):  # what vLLM answered, once the stream had begun
            self.router.bound.pop(id(g), None)
            yield Failure.of(opened)
            return
        async for chunk in self._chunks(g, headers, opened):
            yield chunk

    async def _submit(self, g: Generation, headers: dict, dead: set[int]):
        """Send the generation (again) to a tree that is up and not one of the `dead` gens: (response, gen),
        or a Response to pass on."""
        while True:
            probing = g.charges > 0 and g.charges >= self.max_resumes  # its last chance: alone among suspects
            if probing:
                await self.probe.acquire()
            try:
                r, gen = await self.router.tree_after(dead)
            except BaseException:  # Refused, or cancelled: the client left
                if probing:
                    self.probe.release()
                raise
            if probing:
                self.probing[gen] = g
            if g.resumed and g.text and g.rewindable and g.checked != len(g.generated):
                await self._rewind(g, self.clients[r], headers)
            route, body = g.upstream()
            g.fresh_tokens = 0
            self.router.bound[id(g)] = gen
            try:
                response = await self.pools[r].post(route, msgspec.json.encode(body), headers)
            except httpx.TransportError:
                response = None
            except BaseException:
                self._end_probe(g, gen)
                raise
            if response is not None and response.status_code < 500:
                if response.status_code == 200:
                    return response, gen
                self._end_probe(g, gen)
                content = await response.aread()
                await response.aclose()
                return Response(content, response.status_code, media_type=response.headers.get("content-type"))
            if response is not None:
                content = await response.aread()
                await response.aclose()
            self._end_probe(g, gen)
            if not await self.router.tree_died(gen):
                if response is None:
                    raise Refused(502, "vLLM did not answer")
                return Response(content, response.status_code, media_type=response.headers.get("content-type"))
            self._on_death(g, gen)
            dead.add(gen)

    async def _rewind(self, g: Generation, client: httpx.AsyncClient, headers: dict) -> None:
        """Find text that the dead tree held back (a possible stop string, an incomplete character): the
        last IDs whose text the client did not get all of are made again (Generation.rewind). On a busy
        tree each /detokenize is a wait: the text of all the IDs is asked first; if the client lacks some
        of it, the chunk the client's text stopped at (Generation.likely_keep) is checked; only if that
        fails is each of the REWIND_MAX shorter prefixes asked, all at once."""
        sent, ids = "".join(g.text), list(g.generated)

        async def text_of(keep: int) -> str | None:
            try:
                response = await client.post("/detokenize", headers=headers, timeout=10.0,
                                             json={"model": g.body.get("model"), "tokens": ids[:keep]})
                text = response.json()["prompt"] if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                text = None
            return text if isinstance(text, str) else None
        try:
            whole = await text_of(len(ids))
            if whole is None or sent.startswith(whole):
                return  # (nothing held back; or no rewind, and what was held back is lost)
            keep = g.likely_keep(len(whole) - len(sent)) if whole.startswith(sent) else None
            if keep is not None and len(ids) - REWIND_MAX <= keep < len(ids):
                text = await text_of(keep)
                if text is not None and sent.startswith(text):
                    self._rewound(g, keep, text, len(ids))
                    return
            keeps = range(len(ids) - 1, max(-1, len(ids) - REWIND_MAX - 1), -1)
            for keep, text in zip(keeps, await asyncio.gather(*map(text_of, keeps))):
                if text is None:
                    return
                if sent.startswith(text):
                    self._rewound(g, keep, text, len(ids))
                    return
        finally:
            g.checked = len(g.generated)

    @staticmethod
    def _rewound(g: Generation, keep: int, text: str, streamed: int) -> None:
        g.rewind(keep, text)
        log("resuming from the last token whose text the client got", request=g.id, held_back_tokens=streamed - keep)

    def _end_probe(self, g: Generation, gen: int) -> None:
        if self.probing.get(gen) is g and self.probe.locked():
            self.probe.release()
            if g.fresh_tokens:
                del self.probing[gen]  # proven: a later death of this tree is not its

    def _on_death(self, g: Generation, gen: int) -> None:
        """Tree `gen` died under `g`: count it, or give up on a request that keeps killing the engine."""
        charge(g, probing_other=self.probing.get(gen) not in (None, g))
        if g.charges > self.max_resumes:
            log("gave up on a request that the engine died under every time", "error", request=g.id,
                deaths=g.charges, resumes=g.resumes)
            raise Refused(500, f"the vLLM engine died {g.charges} times in a row while running this request, "
                               f"without a token coming out (--max-resumes {self.max_resumes}); it is not retried")
        g.resumes += 1
        self.resumed_total += 1
        log("resuming a request on a new tree", "warning", request=g.id, tokens=len(g.generated),
            resumes=g.resumes)

    async def _chunks(self, g: Generation, headers: dict, opened):
        """The client's chunks, across as many trees as it takes; a Failure ends them."""
        try:
            async for chunk in self._across_trees(g, headers, opened):
                yield chunk
        finally:
            self.router.bound.pop(id(g), None)

    async def _across_trees(self, g: Generation, headers: dict, opened):
        response, gen = opened
        while True:
            done = failed = False
            failure = Failure(502, error_body(502, "vLLM ended the stream early"))
            buffer = bytearray()
            try:
                async for raw in response.aiter_raw():
                    buffer += raw
                    for data in sse_events(buffer):
                        if data == b"[DONE]":
                            done = True
                            break
                        chunk = msgspec.json.decode(data)
                        code = stream_error(chunk)
                        if code is not None:
                            if code < 500:
                                self._end_probe(g, gen)
                                yield Failure(code, chunk)
                                return
                            failed, failure = True, Failure(code, chunk)
                            break
                        out = g.on_chunk(chunk)
                        if g.fresh_tokens:
                            self._end_probe(g, gen)
                        if out is not None:
                            yield out
                    if done or failed:
                        break
            except (httpx.TransportError, ValueError):
                failed = True
            finally:
                await response.aclose()
                self._end_probe(g, gen)
            if done or g.finish_reason is not None:
                if not done and g.wants_usage and not g.usage_sent:  # cut after its last token
                    yield g.on_chunk({"choices": [], "usage": {}})
                return
            # cut: the tree died under it (or vLLM ended the stream without saying so)
            if g.remaining() is not None and g.remaining() <= 0:
                yield g.finished_here()
                return
            try:
                if not await self.router.tree_died(gen):
                    yield failure  # the tree lives: the failure was this request's own
                    return
                self._on_death(g, gen)
                g.dead.add(gen)
                opened = await self._submit(g, headers, g.dead)
            except Refused as e:
                yield e.failure()
                return
            if isinstance(opened, Response):
                yield Failure.of(opened)
                return
            response, gen = opened


class Streamed(StreamingResponse):
    """A streamed response that ends when the client leaves, and closes its source however it ends: the
    upstream connection closes with it, so vLLM aborts the request. (uvicorn's send drops what a client
    that left is sent without a word, so the front listens for the disconnect itself.) With `keepalive`
    (an SSE stream), an SSE comment goes out after each `keepalive` seconds in which nothing did."""

    def __init__(self, content, *args, keepalive: float | None = None, **kwargs):
        super().__init__(content, *args, **kwargs)
        self.keepalive = keepalive

    async def stream_response(self, send) -> None:
        if self.keepalive is None:
            await super().stream_response(send)
            return
        lock, said = asyncio.Lock(), False

        async def body(chunk: bytes) -> None:
            nonlocal said
            async with lock:
                said = True
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

        async def beat() -> None:
            nonlocal said
            while True:
                said = False
                await asyncio.sleep(self.keepalive)
                if not said:
                    await body(KEEPALIVE)
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        beating = asyncio.ensure_future(beat())
        try:
            async for chunk in self.body_iterator:
                await body(chunk)
        finally:
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        async def until_left():
            while (await receive())["type"] != "http.disconnect":
                pass
        streaming = asyncio.ensure_future(self.stream_response(send))
        left = asyncio.ensure_future(until_left())
        try:
            await asyncio.wait({streaming, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, left):
                task.cancel()
            await asyncio.gather(streaming, left, return_exceptions=True)
            await self.body_iterator.aclose()
        if streaming.done() and not streaming.cancelled() and streaming.exception() is not None:
            raise streaming.exception()


async def relay_raw(response: httpx.Response):
    """The bytes of a response forwarded as it is, its upstream connection closed however it ends."""
    try:
        async for raw in response.aiter_raw():
            yield raw
    finally:
        await response.aclose()
