"""vsup's front for a stock vLLM: the public port, with vLLM behind it on a Unix socket.

Every request is forwarded chunk by chunk. A generation that the tree behind
it dropped (a reset connection, a cut stream, a 5xx from a dead engine) is
held until the supervisor says a new tree is up, then goes on from its token
IDs (vsup/front/resume.py), so the client sees a pause and no error. What vLLM
itself rejects (4xx) passes through unchanged and is never retried.

A stream that gets nothing for --keepalive seconds (a tree restarting can take
minutes) is sent an SSE comment, which clients ignore: a client's read timeout,
or a proxy's, never cuts a stream that the front is holding. A stream held
before its first answer is begun then (200, text/event-stream), and what vLLM
answers after is sent in it, an error as an error event.

With --replicas N there are N trees, each on its own Unix socket: a request
goes to the least loaded one that is up, and one that a tree dropped goes on at
once on another that is up.

The supervisor tells the front of each tree on its stdin, one JSON line per tree
and change: {"replica": R, "gen": N, "up": bool, "stopping": bool, "restarts":
{role: count}}. Gens are unique across replicas: a request remembers the gens it
died on, and never goes back to one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from vsup.front.metrics import merge_replicas
from vsup.front.resume import DONE, ROUTES, Generation, charge, not_resumable, sse, sse_events, stream_error
from vsup.topology import ROLES
from vsup.vllm.names import HELPER

REWIND_MAX = 16  # tokens a resume looks back for text that vLLM held back
KEEPALIVE = b": keep-alive\n\n"
GRACE_S = 5.0  # how long a tree that failed a request may still say it is up before the failure is the request's
HOP_HEADERS = {"host", "authorization", "content-length", "connection", "keep-alive", "transfer-encoding",
               "te", "upgrade", "proxy-authorization", "accept-encoding"}


def log(event: str, level: str = "info", **fields) -> None:
    """One JSON line on stdout: the supervisor tags it as the front's."""
    print(json.dumps({"event": event, "level": level, **fields}, default=str), flush=True)


def error_body(status: int, message: str, kind: str | None = None) -> dict:
    kind = kind or ("invalid_request_error" if status < 500 else "service_unavailable" if status == 503
                    else "internal_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(status: int, message: str, retry_after: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


class Refused(Exception):
    """A request the front gives up on, with the status and message the client gets."""

    def __init__(self, status: int, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


class Trees:
    """What the supervisor last said of each vLLM tree behind the front (one per replica)."""

    def __init__(self, replicas: int):
        self.gens, self.ups = [0] * replicas, [False] * replicas
        self.stopping, self.restarts = False, {}
        self._changed = asyncio.Event()

    def update(self, message: dict) -> None:
        r = int(message.get("replica") or 0)
        if not 0 <= r < len(self.gens):
            raise ValueError(f"replica {r}")
        self.gens[r] = int(message.get("gen", self.gens[r]))
        self.ups[r] = bool(message.get("up"))
        self.stopping = bool(message.get("stopping"))
        self.restarts = dict(message.get("restarts") or {})
        self._changed.set()
        self._changed = asyncio.Event()

    def up(self, avoid: set[int] = frozenset()) -> list[int]:
        """The replicas up now, but not those whose tree is one of the gens `avoid`."""
        return [r for r, (gen, up) in enumerate(zip(self.gens, self.ups)) if up and gen not in avoid]

    def lives(self, gen: int) -> bool:
        """Whether tree `gen` is still the one up on its replica."""
        return any(g == gen and up for g, up in zip(self.gens, self.ups))

    async def changed(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), max(0.0, timeout))
        except asyncio.TimeoutError:
            pass


class Front:
    def __init__(self, upstreams: list[str], upstream_key: str | None, api_key: str | None, resume_timeout: float,
                 max_pending: int, max_resumes: int, keepalive: float):
        self.upstreams, self.upstream_key, self.api_key = upstreams, upstream_key, api_key
        self.resume_timeout, self.max_pending, self.max_resumes = resume_timeout, max_pending, max_resumes
        self.keepalive = keepalive
        self.trees = Trees(len(upstreams))
        self.clients: list[httpx.AsyncClient] = []
        self.bound: dict[int, int] = {}  # generation id -> the gen of the tree it runs on (the load of each)
        self.turn = 0  # (among replicas as loaded: round robin)
        self.pending = 0  # requests waiting for a tree
        self.probe = asyncio.Lock()  # a request that may have killed the tree runs alone until a token comes out
        self.probing: dict[int, Generation] = {}  # tree gen -> the request probing it
        self.resumed_total = 0
        self.reader: asyncio.Task | None = None  # (held: the loop keeps only a weak reference to a task)

    # the ASGI app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        try:
            response = await self.handle(request)
        except Refused as e:
            response = error_response(e.status, e.message, e.retry_after)
        await response(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
                self.clients = [httpx.AsyncClient(base_url="http://vllm", timeout=httpx.Timeout(None, connect=5.0),
                                                  transport=httpx.AsyncHTTPTransport(uds=path, limits=limits))
                                for path in self.upstreams]
                self.reader = asyncio.get_running_loop().create_task(self._read_supervisor())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for client in self.clients:
                    await client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _read_supervisor(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            try:
                self.trees.update(json.loads(line))
            except (ValueError, TypeError, AttributeError):
                log("dropped a malformed line from the supervisor", "warning", line=line[:200].decode(errors="replace"))
        log("the supervisor is gone: exiting", "error")
        sys.exit(1)  # (PR_SET_PDEATHSIG would end it too)

    async def handle(self, request: Request) -> Response:
        path = request.url.path
        if self.api_key and path.startswith("/v1") and not self._authorized(request):
            return error_response(401, "Unauthorized: give the API key as 'Authorization: Bearer KEY'")
        if path == "/health":
            return await self._health()
        if path == "/metrics":
            return await self._metrics()
        body = await request.body()
        kind = ROUTES.get(path) if request.method == "POST" else None
        if kind is not None:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and not_resumable(kind, parsed) is None:
                return await self.generate(Generation(kind, parsed), self._headers(request))
        return await self.forward(request, body)

    def _authorized(self, request: Request) -> bool:
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())

    def _headers(self, request: Request) -> dict:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if self.upstream_key:
            headers["authorization"] = f"Bearer {self.upstream_key}"
        return headers

    # the tree

    async def tree_after(self, avoid: set[int]) -> tuple[int, int]:
        """(replica, gen) of a tree that is up and none of the gens `avoid` (those that died under the
        request), the least loaded; holding the request until there is one."""
        trees = self.trees
        if not trees.up(avoid):
            if trees.stopping:
                raise Refused(503, "vsup is stopping this deployment")
            if self.pending >= self.max_pending:
                raise Refused(503, f"{self.pending} requests already wait for vLLM to come back (--max-pending "
                                   f"{self.max_pending}); retry later", retry_after=5)
            self.pending += 1
            deadline = time.monotonic() + self.resume_timeout
            try:
                while not trees.up(avoid):
                    if trees.stopping:
                        raise Refused(503, "vsup is stopping this deployment")
                    if time.monotonic() >= deadline:
                        raise Refused(503, f"vLLM did not come back within --resume-timeout "
                                           f"{self.resume_timeout:g} s", retry_after=5)
                    await trees.changed(deadline - time.monotonic())
            finally:
                self.pending -= 1
        up = trees.up(avoid)
        self.turn += 1
        load = {gen: 0 for gen in trees.gens}
        for gen in self.bound.values():
            load[gen] = load.get(gen, 0) + 1
        r = min(up, key=lambda r: (load[trees.gens[r]], (r - self.turn) % len(trees.gens)))
        return r, trees.gens[r]

    async def tree_died(self, gen: int) -> bool:
        """After a request failed on tree `gen`: whether that tree died (False: it lives, the failure was
        the request's own)."""
        deadline = time.monotonic() + GRACE_S
        while self.trees.lives(gen) and time.monotonic() < deadline:
            await self.trees.changed(deadline - time.monotonic())
        return not self.trees.lives(gen)

    # generations: streamed, held and resumed

    async def generate(self, g: Generation, headers: dict) -> Response:
        submitting = asyncio.ensure_future(self._submit(g, headers, g.dead))
        if g.streams:  # begun at once if the answer takes --keepalive seconds (no tree up, say)
            await asyncio.wait({submitting}, timeout=self.keepalive)
            if not submitting.done():
                return self._streamed(g, headers, submitting)
        try:
            opened = await submitting
        except Refused as e:
            opened = error_response(e.status, e.message, e.retry_after)
        if isinstance(opened, Response):
            self.bound.pop(id(g), None)  # (it counts in the load of a tree while it runs there)
            return opened
        if g.streams:
            return self._streamed(g, headers, submitting)
        error = None
        async with contextlib.aclosing(self._chunks(g, headers, opened)) as chunks:
            async for chunk in chunks:
                if "error" in chunk:
                    error = chunk
        if error is not None:
            return JSONResponse(error, status_code=error["error"].get("code") or 500)
        return JSONResponse(g.response())

    def _streamed(self, g: Generation, headers: dict, submitting: asyncio.Future) -> Streamed:
        return Streamed(self._stream(g, headers, submitting), media_type="text/event-stream",
                        headers={"x-accel-buffering": "no"}, keepalive=self.keepalive)

    async def _stream(self, g: Generation, headers: dict, submitting: asyncio.Future):
        async with contextlib.aclosing(self._submitted(g, headers, submitting)) as chunks:  # closed if the client left
            async for chunk in chunks:
                yield sse(chunk)
        yield DONE

    async def _submitted(self, g: Generation, headers: dict, submitting: asyncio.Future):
        """The chunks of a streamed generation whose submission may still be under way."""
        try:
            opened = await submitting
        except Refused as e:
            yield error_body(e.status, e.message)
            return
        if isinstance(opened, Response):  # what vLLM answered, once the stream had begun
            self.bound.pop(id(g), None)
            yield as_error(opened)
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
                r, gen = await self.tree_after(dead)
            except BaseException:  # Refused, or cancelled: the client left
                if probing:
                    self.probe.release()
                raise
            if probing:
                self.probing[gen] = g
            client = self.clients[r]
            if g.resumed and g.text and g.rewindable and g.checked != len(g.generated):
                await self._rewind(g, client, headers)
            route, body = g.upstream()
            g.fresh_tokens = 0
            self.bound[id(g)] = gen
            try:
                response = await client.send(client.build_request("POST", route, json=body, headers=headers),
                                             stream=True)
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
            if not await self.tree_died(gen):
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
        """The client's chunks, across as many trees as it takes; an error chunk ends them."""
        try:
            async for chunk in self._across_trees(g, headers, opened):
                yield chunk
        finally:
            self.bound.pop(id(g), None)

    async def _across_trees(self, g: Generation, headers: dict, opened):
        response, gen = opened
        while True:
            done = failed = False
            failure = error_body(502, "vLLM ended the stream early")
            buffer = bytearray()
            try:
                async for raw in response.aiter_raw():
                    buffer += raw
                    for data in sse_events(buffer):
                        if data == b"[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        code = stream_error(chunk)
                        if code is not None:
                            if code < 500:
                                self._end_probe(g, gen)
                                yield chunk
                                return
                            failed, failure = True, chunk
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
                if not await self.tree_died(gen):
                    yield failure  # the tree lives: the failure was this request's own
                    return
                self._on_death(g, gen)
                g.dead.add(gen)
                opened = await self._submit(g, headers, g.dead)
            except Refused as e:
                yield error_body(e.status, e.message)
                return
            if isinstance(opened, Response):
                yield as_error(opened)
                return
            response, gen = opened

    # everything else, forwarded as it is

    async def forward(self, request: Request, body: bytes) -> Response:
        headers = self._headers(request)
        dead: set[int] = set()
        while True:
            r, gen = await self.tree_after(dead)
            client = self.clients[r]
            upstream = client.build_request(request.method, request.url.path, params=request.query_params,
                                            content=body, headers=headers)
            try:
                response = await client.send(upstream, stream=True)
            except httpx.TransportError:
                if not await self.tree_died(gen):
                    return error_response(502, "vLLM did not answer")
                dead.add(gen)
                continue
            kept = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
            return Streamed(_relay(response), status_code=response.status_code, headers=kept)

    async def _health(self) -> Response:
        up = self.trees.up()
        if not up:
            return error_response(503, "vLLM is not up" + (" (stopping)" if self.trees.stopping else ""))
        try:
            response = await self.clients[up[0]].get("/health", timeout=5.0)
        except httpx.TransportError:
            return error_response(503, "vLLM does not answer /health")
        return Response(response.content, response.status_code)

    async def _metrics(self) -> Response:
        """vLLM's own /metrics (each replica's, labelled with it), with vsup's counters beside them: one
        scrape target."""
        texts = {}
        for r in self.trees.up():
            try:
                response = await self.clients[r].get("/metrics", timeout=5.0)
                if response.status_code == 200:
                    texts[r] = response.text
            except httpx.TransportError:
                pass
        text = texts.get(0, "") if len(self.clients) == 1 else merge_replicas(texts)
        lines = ["# HELP vsup_restarts_total vLLM trees vsup restarted, by the role whose process died.",
                 "# TYPE vsup_restarts_total counter"]
        lines += [f'vsup_restarts_total{{role="{role}"}} {int(self.trees.restarts.get(role, 0))}'
                  for role in (*ROLES, HELPER)]
        lines += ["# HELP vsup_front_resumed_total Requests the front resumed on a new tree.",
                  "# TYPE vsup_front_resumed_total counter", f"vsup_front_resumed_total {self.resumed_total}",
                  "# HELP vsup_front_pending Requests waiting for a vLLM tree now.",
                  "# TYPE vsup_front_pending gauge", f"vsup_front_pending {self.pending}"]
        return PlainTextResponse(text + "\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def as_error(response: Response) -> dict:
    """What vLLM answered instead of a stream, as the error event of a stream already begun."""
    try:
        body = json.loads(response.body)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body
    return error_body(response.status_code, response.body.decode(errors="replace"))


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


async def _relay(response: httpx.Response):
    try:
        async for raw in response.aiter_raw():
            yield raw
    finally:
        await response.aclose()
