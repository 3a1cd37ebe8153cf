"""vsup's front for a stock vLLM: the public port, with vLLM behind it on a Unix socket.

The app's routes: the OpenAI generations go through the relay (relay.py), which holds and resumes them
across a tree's death; everything else is forwarded as it is to a tree that is up (routing.py);
/health and /metrics are the front's own, /metrics with each replica's vLLM metrics beside vsup's.
With --replicas N there are N trees, each on its own Unix socket: a request goes to the least loaded
one that is up, and one that a tree dropped goes on at once on another that is up.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys

import httpx
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from vsup.front.errors import Refused, error_response
from vsup.front.log import log
from vsup.front.metrics import merge_replicas
from vsup.front.relay import Relay, Streamed, relay_raw
from vsup.front.resume import ROUTES, Generation, not_resumable
from vsup.front.routing import Router
from vsup.front.upstream import Pool
from vsup.messages import TreeNews, decode
from vsup.topology import ROLES
from vsup.vllm.names import HELPER

HOP_HEADERS = {"host", "authorization", "content-length", "connection", "keep-alive", "transfer-encoding",
               "te", "upgrade", "proxy-authorization", "accept-encoding"}


class Front:
    def __init__(self, upstreams: list[str], upstream_key: str | None, api_key: str | None, resume_timeout: float,
                 max_pending: int, max_resumes: int, keepalive: float):
        self.upstreams, self.upstream_key, self.api_key = upstreams, upstream_key, api_key
        self.router = Router(len(upstreams), resume_timeout, max_pending)
        self.relay = Relay(self.router, max_resumes, keepalive)
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
            response = e.response()
        await response(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
                timeout = httpx.Timeout(None, connect=5.0)
                self.relay.clients = [httpx.AsyncClient(base_url="http://vllm", timeout=timeout,
                                                        transport=httpx.AsyncHTTPTransport(uds=path, limits=limits))
                                      for path in self.upstreams]
                self.relay.pools = [Pool(path) for path in self.upstreams]
                self.reader = asyncio.get_running_loop().create_task(self._read_supervisor())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for client in [*self.relay.clients, *self.relay.pools]:
                    await client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _read_supervisor(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            try:
                self.router.trees.update(decode(line, TreeNews))
            except ValueError:
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
                return await self.relay.generate(Generation(kind, parsed), self._headers(request))
        return await self.forward(request, body)

    def _authorized(self, request: Request) -> bool:
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())

    def _headers(self, request: Request) -> dict:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if self.upstream_key:
            headers["authorization"] = f"Bearer {self.upstream_key}"
        return headers

    # everything else, forwarded as it is

    async def forward(self, request: Request, body: bytes) -> Response:
        headers = self._headers(request)
        dead: set[int] = set()
        while True:
            r, gen = await self.router.tree_after(dead)
            client = self.relay.clients[r]
            upstream = client.build_request(request.method, request.url.path, params=request.query_params,
                                            content=body, headers=headers)
            try:
                response = await client.send(upstream, stream=True)
            except httpx.TransportError:
                if not await self.router.tree_died(gen):
                    return error_response(502, "vLLM did not answer")
                dead.add(gen)
                continue
            kept = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
            return Streamed(relay_raw(response), status_code=response.status_code, headers=kept)

    async def _health(self) -> Response:
        up = self.router.trees.up()
        if not up:
            return error_response(503, "vLLM is not up" + (" (stopping)" if self.router.trees.stopping else ""))
        try:
            response = await self.relay.clients[up[0]].get("/health", timeout=5.0)
        except httpx.TransportError:
            return error_response(503, "vLLM does not answer /health")
        return Response(response.content, response.status_code)

    async def _metrics(self) -> Response:
        """vLLM's own /metrics (each replica's, labelled with it), with vsup's counters beside them: one
        scrape target."""
        texts = {}
        for r in self.router.trees.up():
            try:
                response = await self.relay.clients[r].get("/metrics", timeout=5.0)
                if response.status_code == 200:
                    texts[r] = response.text
            except httpx.TransportError:
                pass
        text = texts.get(0, "") if len(self.relay.clients) == 1 else merge_replicas(texts)
        lines = ["# HELP vsup_restarts_total vLLM trees vsup restarted, by the role whose process died.",
                 "# TYPE vsup_restarts_total counter"]
        lines += [f'vsup_restarts_total{{role="{role}"}} {int(self.router.trees.restarts.get(role, 0))}'
                  for role in (*ROLES, HELPER)]
        lines += ["# HELP vsup_incidents_total Units that went down unasked, by role and cause.",
                  "# TYPE vsup_incidents_total counter"]
        lines += [f'vsup_incidents_total{{role="{key.split("/")[0]}",cause="{key.split("/")[-1]}"}} {n}'
                  for key, n in sorted(self.router.trees.incidents.items())]
        lines += ["# HELP vsup_front_resumed_total Requests the front resumed on a new tree.",
                  "# TYPE vsup_front_resumed_total counter", f"vsup_front_resumed_total {self.relay.resumed_total}",
                  "# HELP vsup_front_pending Requests waiting for a vLLM tree now.",
                  "# TYPE vsup_front_pending gauge", f"vsup_front_pending {self.router.pending}"]
        return PlainTextResponse(text + "\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


