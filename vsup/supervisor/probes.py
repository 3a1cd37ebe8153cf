"""The kubelet's probes on `--probe-port`: what a pod's vsup says of itself, with no API key (the kubelet has
none; serving stays behind --api-key). Every pod of a group answers them, the headless ones included.

    GET /livez   200 while the supervisor's loop turns. A restart inside the pod is the loop at work, so it
                 stays 200: the kubelet must never restart the container for it (under a LeaderWorkerSet
                 that would recreate the whole group). 503 when the loop has not turned for STUCK_S.
    GET /readyz  200 while this node's every unit is ready and the deployment serves (an idle pod is
                 ready); on a head whose DP ranks run on other nodes too, also while its API servers see
                 every rank up (their /health `ok`: a lost node makes the head's pod unready); 503 with
                 what is not, as one line of text.
    GET /group   on the head of a stock vLLM across nodes: another node's signed report of its part, and
                 this head's answer (group.py); 403 for a report that is not signed with the cluster secret.

The answers are read from what the loop's thread last published (`Probes.publish`); this thread writes
no supervisor state.
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STUCK_S = 10.0  # the loop beats every second: this many seconds without a beat is a stuck supervisor
BEAT_S = 1.0


class Probes:
    """The answers, published by the loop's thread, served by a thread of their own."""

    def __init__(self, sock: socket.socket, health_url: str | None = None, group=None):
        """`health_url`: the API servers' /health, asked at each /readyz (from this thread) when ranks run on
        other nodes; `group(query) -> (status, body)`: what answers /group, on this thread."""
        self.beat = time.monotonic()
        self.ready: tuple[bool, str] = (False, "starting")
        self.health_url, self.group = health_url, group
        self.server = _Server(sock, self)
        self.thread = threading.Thread(target=self.server.serve_forever, name="probes", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def publish(self, ready: bool, why: str) -> None:
        """From the loop's thread: it turns (a beat), and whether this node is ready."""
        self.beat = time.monotonic()
        self.ready = (ready, why)

    def answer(self, path: str) -> tuple[int, str]:
        path, _, query = path.partition("?")
        if path == "/group" and self.group is not None:
            from urllib.parse import parse_qsl

            return self.group(dict(parse_qsl(query)))
        if path == "/livez":
            quiet = time.monotonic() - self.beat
            return (200, "ok\n") if quiet < STUCK_S else (503, f"the supervisor's loop is stuck ({quiet:.0f} s)\n")
        if path == "/readyz":
            ready, why = self.ready
            if ready and self.health_url:
                ready, why = self.ranks_up()
            return (200, "ok\n") if ready else (503, f"{why}\n")
        return 404, "the probes are /livez and /readyz\n"

    def ranks_up(self) -> tuple[bool, str]:
        """Whether the API servers see every DP rank up, and if not, what their /health says is down."""
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as reply:
                body = json.loads(reply.read())
        except OSError as e:  # (a 503 is an HTTPError, an OSError: its body says which ranks)
            body = _json_body(e)
            if body is None:
                return False, f"the API servers' /health did not answer ({e})"
        if body.get("status") == "ok":
            return True, "ok"
        return False, f"the API servers' /health says {body.get('status')}: {body.get('message') or ''}".strip()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, sock: socket.socket, probes: Probes):
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket, self.probes = sock, probes
        sock.listen(16)


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        status, body = self.server.probes.answer(self.path)
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # the kubelet asks every few seconds: not a line each time
        pass


def _json_body(error: OSError) -> dict | None:
    import json

    try:
        return json.loads(error.read())  # an HTTPError's body
    except (AttributeError, OSError, ValueError):
        return None
