"""vsup's front (`python -m vsup.front`, a real process on a real port) before a stand-in vLLM on a Unix
socket (as vLLM's --uds behind the front).

The stand-in speaks vLLM's streaming protocol with `return_token_ids`, and its "model" is
deterministic: the next token depends only on the IDs before it, so a generation resumed from
its IDs must go on with exactly the tokens of a run without the fault. It can die like a vLLM
tree: every stream it runs is cut at once. The test plays the supervisor on the front's stdin.
The same promises are shown on a real vLLM in tests/e2e/test_vllm*.py; these cover the front's
rules fast, in every `make test`.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import httpx
import openai
import pytest
import uvicorn

from tests.polling import wait_for

KEY = "front-test-key"
UPSTREAM_KEY = "private-upstream-key"
POISON = "POISON"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def next_token(ids: list[int]) -> int:
    return (sum(ids) * 31 + len(ids)) % 997 + 1


class StandIn:
    """A stand-in vLLM tree: /v1/completions and /v1/chat/completions, streamed, with token IDs."""

    def __init__(self):
        self.gen = 1
        self.bodies: list[dict] = []
        self.die_after: int | None = None  # die when any stream has sent this many tokens
        self.disconnects = 0
        self.socket = os.path.join(tempfile.mkdtemp(prefix="vsup-stand-in-"), "vllm.sock")  # as vLLM's --uds
        self.tokens_per_s = 200.0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/health":  # (vLLM asks no key for it)
            await self._json(send, 200, {})
            return
        if dict(scope["headers"]).get(b"authorization") != f"Bearer {UPSTREAM_KEY}".encode():
            await self._json(send, 401, {"error": {"message": "wrong key", "code": 401}})
            return
        request = json.loads(body)
        if scope["path"] == "/detokenize":
            await self._json(send, 200, {"prompt": "".join(f" w{t}" for t in request["tokens"])})
            return
        self.bodies.append(request)
        if request.get("max_tokens") == 999:
            await self._json(send, 400, {"error": {"message": "max_tokens too big", "type": "BadRequestError",
                                                   "param": "max_tokens", "code": 400}})
            return
        left = asyncio.Event()

        async def watch():  # the client (the front) closing its connection
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()
        watcher = asyncio.create_task(watch())
        try:
            await self._stream(scope, request, send, left)
        finally:
            watcher.cancel()

    async def _stream(self, scope, request, send, left):
        chat = scope["path"] == "/v1/chat/completions"
        prompt = request["prompt"] if not chat else "".join(m["content"] for m in request["messages"])
        ids = list(prompt) if isinstance(prompt, list) else [ord(c) for c in prompt]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        gen, n = self.gen, request.get("max_tokens") or 8
        head = {"id": f"cmpl-{len(self.bodies)}", "created": 1, "model": "tiny"}
        first = {**head, "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": None,
                                      "prompt_token_ids": ids}]}
        if chat:
            first = {**head, "prompt_token_ids": ids,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]}
        await self._event(send, first)
        held = ""  # with a stop string, like vLLM, the last token's text waits until the next one comes
        for i in range(n):
            if POISON in str(prompt) or (POISON_IDS and _holds(ids, POISON_IDS)):
                self.die()
            if self.gen != gen:
                raise ConnectionResetError("the tree died")  # uvicorn drops the connection mid-stream
            await asyncio.sleep(1 / self.tokens_per_s)
            if left.is_set():
                self.disconnects += 1
                return
            token = next_token(ids)
            ids.append(token)
            text = f" w{token}"
            finish = "length" if i == n - 1 else None
            if request.get("stop"):
                text, held = (held if finish is None else held + text), (text if finish is None else "")
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            await self._event(send, {**head, "choices": [{**choice, "token_ids": [token], "finish_reason": finish}]})
            if self.die_after is not None and i + 1 >= self.die_after:
                self.die_after = None
                self.die()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def die(self):
        self.gen += 1
        self.on_death(self.gen)

    async def _event(self, send, chunk):
        await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                    "more_body": True})

    async def _json(self, send, status, body):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


POISON_IDS = [ord(c) for c in POISON]


def _holds(ids, marker):
    return any(ids[i:i + len(marker)] == marker for i in range(len(ids) - len(marker) + 1))


class Front:
    """The front process, with the test as its supervisor."""

    def __init__(self, upstream: str, *flags: str, more_upstreams: tuple[str, ...] = (),
                 held: socket.socket | None = None):
        """`held`: the port's socket, bound and held by the test as the supervisor holds it (--listen-fd)."""
        self.port = held.getsockname()[1] if held else free_port()
        upstreams = [x for path in (upstream, *more_upstreams) for x in ("--upstream", path)]
        listen = ["--listen-fd", str(held.fileno())] if held else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vsup.front", "--host", "127.0.0.1", "--port", str(self.port), *upstreams,
             "--drain-timeout", "5", *listen, *flags], pass_fds=(held.fileno(),) if held else (),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "VSUP_API_KEY": KEY, "VSUP_FRONT_UPSTREAM_KEY": UPSTREAM_KEY})
        self.lines: list[str] = []  # read as it comes, or the front would block on a full pipe
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_for(lambda: self._listening(), timeout=30, what="the front listening")
        except TimeoutError:
            self.close()
            raise
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def _listening(self) -> bool:
        try:
            httpx.get(f"{self.url}/health", timeout=1)
            return True
        except httpx.TransportError:
            return False

    def tell(self, gen: int, up: bool, stopping: bool = False, restarts: dict | None = None, replica: int = 0):
        try:
            self.proc.stdin.write(json.dumps({"replica": replica, "gen": gen, "up": up, "stopping": stopping,
                                              "restarts": restarts or {}}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # closed: a restart's timer that outlived its test
            pass

    def close(self):
        self.proc.kill()
        self.proc.wait(10)


@contextlib.contextmanager
def serving(app: StandIn):
    server = uvicorn.Server(uvicorn.Config(app, uds=app.socket, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=30, what="the stand-in listening")
    try:
        yield app
    finally:
        server.should_exit = True
        thread.join(10)
        shutil.rmtree(os.path.dirname(app.socket), ignore_errors=True)


@pytest.fixture
def stand_in():
    with serving(StandIn()) as app:
        yield app


@contextlib.contextmanager
def supervised(stand_in: StandIn, restart_s: float, *flags: str):
    """A front before `stand_in`, with the test as the supervisor: when the tree dies it is down, and
    `restart_s` later the next one is up."""
    f = Front(stand_in.socket, "--max-resumes", "1", "--max-pending", "3", "--resume-timeout", "20", *flags)

    def restarted(gen):
        f.tell(gen - 1, False)
        threading.Timer(restart_s, f.tell, args=(gen, True)).start()
    stand_in.on_death = restarted
    try:
        f.tell(1, True)
        wait_for(lambda: httpx.get(f"{f.url}/health").status_code == 200, timeout=10, what="the front sees the tree")
        yield f
    finally:
        f.close()


@pytest.fixture
def front(stand_in):
    with supervised(stand_in, 0.3) as f:
        yield f


def fault_free_text(prompt: str, n: int) -> str:
    ids = [ord(c) for c in prompt]
    out = []
    for _ in range(n):
        ids.append(next_token(ids))
        out.append(f" w{ids[-1]}")
    return "".join(out)


def test_a_request_waiting_for_a_front_that_dies_is_answered_by_the_next_one_on_the_held_socket(stand_in):
    """The supervisor holds the port's socket and each front serves it: a request sent while the front is
    frozen (its connection waits, not accepted) survives the front's kill -9 and is answered by the next
    front; a front with a socket of its own would have taken it along (a reset)."""
    flags = ("--max-resumes", "1", "--max-pending", "3", "--resume-timeout", "20")
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        first = Front(stand_in.socket, *flags, held=held)
        try:
            first.tell(1, True)
            first.proc.send_signal(signal.SIGSTOP)
            conn = http.client.HTTPConnection("127.0.0.1", first.port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps({"model": "tiny", "prompt": "hello",
                                                                     "max_tokens": 12}),
                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        finally:
            first.close()
        second = Front(stand_in.socket, *flags, held=held)
        try:
            second.tell(1, True)
            response = conn.getresponse()
            assert response.status == 200
            assert json.loads(response.read())["choices"][0]["text"] == fault_free_text("hello", 12)
        finally:
            conn.close()
            second.close()


def test_a_stream_cut_by_a_dying_tree_goes_on_with_the_same_tokens(front, stand_in):
    stand_in.die_after = 5
    chunks = list(front.client.completions.create(model="tiny", prompt="hello", max_tokens=12, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == fault_free_text("hello", 12)  # no token lost, none repeated
    assert len(stand_in.bodies) == 2 and stand_in.gen == 2
    resumed = stand_in.bodies[1]
    assert resumed["prompt"][:5] == [ord(c) for c in "hello"] and len(resumed["prompt"]) == 5 + 5
    assert resumed["max_tokens"] == 7 and resumed["return_token_ids"] is True
    assert {c.id for c in chunks} == {chunks[0].id}  # one stream to the client
    assert not any(getattr(c.choices[0], "token_ids", None) for c in chunks if c.choices)  # not asked for


def test_a_chat_that_did_not_stream_gets_one_whole_response_after_a_death(front, stand_in):
    stand_in.die_after = 3
    reply = front.client.chat.completions.create(model="tiny", max_tokens=10,
                                                 messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == fault_free_text("hi", 10)
    assert reply.usage.completion_tokens == 10 and reply.usage.prompt_tokens == 2
    assert stand_in.bodies[1]["prompt"][:2] == [ord("h"), ord("i")]  # resumed as a completion from IDs


def test_what_vllm_rejects_passes_through_and_is_never_retried(front, stand_in):
    with pytest.raises(openai.BadRequestError) as e:
        front.client.completions.create(model="tiny", prompt="x", max_tokens=999)
    assert e.value.body["message"] == "max_tokens too big" and e.value.body["param"] == "max_tokens"
    assert len(stand_in.bodies) == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{front.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_client_that_leaves_closes_the_upstream_stream(front, stand_in):
    stand_in.tokens_per_s = 20
    with httpx.stream("POST", f"{front.url}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": "abc", "max_tokens": 400, "stream": True}) as response:
        for line in response.iter_lines():
            if ' w' in line:
                break
    # the front closed its upstream connection, so the stand-in (like vLLM) stops generating for nobody
    wait_for(lambda: stand_in.disconnects == 1, timeout=10, what="the upstream stream closed")
    reply = front.client.completions.create(model="tiny", prompt="next", max_tokens=4)
    assert reply.choices[0].text == fault_free_text("next", 4)


def test_requests_wait_for_the_next_tree_up_to_max_pending(front, stand_in):
    front.tell(1, False)  # the tree is down: requests are held
    results: list = []

    def ask(i):
        try:
            results.append(front.client.completions.create(model="tiny", prompt=f"p{i}", max_tokens=3).choices[0].text)
        except openai.APIStatusError as e:
            results.append(e)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: "vsup_front_pending 3" in httpx.get(f"{front.url}/metrics").text, timeout=10,
             what="3 requests held")
    with pytest.raises(openai.APIStatusError) as e:
        front.client.completions.create(model="tiny", prompt="one too many", max_tokens=3)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "5"
    assert "--max-pending 3" in e.value.message
    front.tell(2, True, restarts={"worker": 1})
    for t in threads:
        t.join(30)
    assert sorted(results) == sorted(fault_free_text(f"p{i}", 3) for i in range(3))
    assert 'vsup_restarts_total{role="worker"} 1' in httpx.get(f"{front.url}/metrics").text


def test_a_poison_request_fails_after_max_resumes_and_the_others_go_on(front, stand_in):
    stand_in.tokens_per_s = 50
    results: dict = {}
    streamed: dict = {}

    def run(name, prompt):
        try:
            text = ""
            for c in front.client.completions.create(model="tiny", prompt=prompt, max_tokens=40, stream=True):
                text += c.choices[0].text if c.choices else ""
                streamed[name] = len(text)
            results[name] = text
        except openai.APIError as e:
            results[name] = e
    innocents = [threading.Thread(target=run, args=(f"ok{i}", f"story {i}")) for i in range(3)]
    for t in innocents:
        t.start()
    wait_for(lambda: all(streamed.get(f"ok{i}") for i in range(3)) and not results, timeout=10,
             what="3 streams under way before the poison request")
    bad = threading.Thread(target=run, args=("bad", f"a {POISON} b"))
    bad.start()
    for t in [*innocents, bad]:
        t.join(60)
    assert isinstance(results["bad"], openai.APIError) and "--max-resumes 1" in str(results["bad"])
    assert {k: v for k, v in results.items() if k != "bad"} == {f"ok{i}": fault_free_text(f"story {i}", 40)
                                                                for i in range(3)}
    assert stand_in.gen == 3  # its first try and its one resume: no crash loop


def test_a_stopping_deployment_refuses_instead_of_holding(front, stand_in):
    front.tell(1, False, stopping=True)
    with pytest.raises(openai.APIStatusError) as e:
        front.client.completions.create(model="tiny", prompt="late", max_tokens=3)
    assert e.value.status_code == 503 and "stopping" in e.value.message
    assert httpx.get(f"{front.url}/health").status_code == 503


def test_with_two_replicas_a_dead_trees_streams_move_to_the_other_at_once(stand_in):
    """Replica 0 dies under its streams and stays down (no new tree): they go on on replica 1 at once,
    with the same tokens. The front spread the 4 streams 2 and 2 (the least loaded first)."""
    with serving(StandIn()) as other:
        f = Front(stand_in.socket, "--max-resumes", "1", "--max-pending", "3", "--resume-timeout", "20",
                  more_upstreams=(other.socket,))
        try:
            stand_in.on_death = lambda _: f.tell(1, False, replica=0)  # the dead tree: down, nothing new yet
            other.on_death = lambda _: pytest.fail("replica 1 died")
            f.tell(1, True, replica=0)
            f.tell(2, True, replica=1)  # gens are unique across replicas
            wait_for(lambda: httpx.get(f"{f.url}/health").status_code == 200, timeout=10, what="the trees up")
            stand_in.tokens_per_s = other.tokens_per_s = 50.0
            stand_in.die_after = 6
            results = {}

            def run(i):
                chunks = f.client.completions.create(model="tiny", prompt=f"story {i}", max_tokens=20, stream=True)
                results[i] = "".join(c.choices[0].text for c in chunks if c.choices)
            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert results == {i: fault_free_text(f"story {i}", 20) for i in range(4)}
            assert len(stand_in.bodies) == 2 and len(other.bodies) == 4  # 2 each, then replica 0's 2 moved
            moved = other.bodies[2:]
            assert all(len(b["prompt"]) > len("story 0") for b in moved)  # resumed from their IDs
            assert httpx.get(f"{f.url}/health").status_code == 200  # replica 1 serves on
        finally:
            f.close()


def test_text_held_back_for_a_stop_string_is_not_lost_at_a_cut(front, stand_in):
    """With a stop string the tree holds back the last token's text; the tree dies before sending it.
    The resume makes that token again, so the client gets all of the text, once."""
    stand_in.die_after = 5
    chunks = list(front.client.completions.create(model="tiny", prompt="hello", max_tokens=12, stream=True,
                                                  stop=["never"]))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == fault_free_text("hello", 12)
    assert len(stand_in.bodies[1]["prompt"]) == 5 + 4  # from the last token whose text the client got
    assert any("held_back_tokens" in line for line in front.lines)


@pytest.fixture
def slow_front(stand_in):
    """A front whose tree takes 3 s to come back, 15 times its keep-alive interval and 3 times its
    clients' read timeout (a vLLM tree takes 45 s to 4 minutes on two cores)."""
    with supervised(stand_in, 3.0, "--keepalive", "0.2") as f:
        f.client = f.client.with_options(timeout=1.0)
        yield f


def raw_stream(front, prompt: str, **body) -> list[str]:
    """The lines of an SSE stream as a client with a 1 s read timeout gets them."""
    with httpx.stream("POST", f"{front.url}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": prompt, "stream": True, **body}, timeout=1.0) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line]


def texts_of(lines: list[str]) -> str:
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def test_a_stream_held_through_a_long_restart_is_kept_alive_past_its_read_timeout(slow_front, stand_in):
    """The tree dies under two streams and is back 3 s later; each client gives up after 1 s of silence.
    The front's SSE comments keep both streams open, the official client skips them, and both go on
    with the tokens of a run without the fault."""
    stand_in.tokens_per_s = 50
    stand_in.die_after = 5
    official: dict = {}

    def run():
        chunks = slow_front.client.completions.create(model="tiny", prompt="story", max_tokens=12, stream=True)
        official["text"] = "".join(c.choices[0].text for c in chunks if c.choices)
    thread = threading.Thread(target=run)
    thread.start()
    lines = raw_stream(slow_front, "hello", max_tokens=12)
    thread.join(30)
    assert stand_in.gen == 2  # one death, under both
    assert texts_of(lines) == fault_free_text("hello", 12) and official == {"text": fault_free_text("story", 12)}
    assert lines.count(": keep-alive") >= 10 and lines[-1] == "data: [DONE]"


def test_a_stream_asked_for_while_no_tree_is_up_begins_and_waits_for_one(slow_front, stand_in):
    """A stream asked for while the tree is down is begun after --keepalive, kept alive until a tree is
    up, then served; what vLLM then rejects arrives as the stream's error event, as vLLM sends one."""
    slow_front.tell(1, False)
    threading.Timer(3.0, slow_front.tell, args=(2, True)).start()
    results: dict = {}

    def rejected():
        try:
            list(slow_front.client.completions.create(model="tiny", prompt="x", max_tokens=999, stream=True))
        except openai.APIError as e:
            results["rejected"] = e
    thread = threading.Thread(target=rejected)
    thread.start()
    lines = raw_stream(slow_front, "late", max_tokens=6)
    thread.join(30)
    assert texts_of(lines) == fault_free_text("late", 6) and ": keep-alive" in lines
    assert "max_tokens too big" in str(results["rejected"])
    assert [b["max_tokens"] for b in stand_in.bodies] in ([6, 999], [999, 6])  # each sent once, when a tree was up


def test_a_client_that_leaves_while_its_suspect_request_waits_does_not_block_the_next_suspect(slow_front,
                                                                                              stand_in):
    """A request resumed after killing the tree waits for the next one alone among suspects; its client
    leaving meanwhile must free that turn, or every later suspect would wait for good."""
    with httpx.stream("POST", f"{slow_front.url}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": f"a {POISON}", "max_tokens": 8, "stream": True},
                      timeout=5.0) as response:
        lines = response.iter_lines()  # (held: a dropped iterator closes the stream)
        next(line for line in lines if line.startswith("data: {"))  # begun, then the tree died under it
        wait_for(lambda: any("resuming a request" in line for line in slow_front.lines), timeout=5,
                 what="the poison request waiting for the next tree")
    # (the client left before the tree was back)
    outcome: list = []

    def suspect():  # in a thread: kept alive by the front, a blocked request would wait for good
        try:
            list(slow_front.client.completions.create(model="tiny", prompt=f"b {POISON}", max_tokens=8, stream=True))
        except openai.APIError as e:
            outcome.append(e)
    thread = threading.Thread(target=suspect, daemon=True)
    thread.start()
    thread.join(20)
    assert outcome and "--max-resumes 1" in str(outcome[0]), "the next suspect request never got its turn"
    assert stand_in.gen == 4  # each poison request killed a tree once, and the second once more on its resume
