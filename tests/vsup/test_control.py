"""The control socket answers and logs what is no command, and never dies of it nor waits on it."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from vsup.supervisor import control
from vsup.supervisor.loop import Loop


class Supervisor:
    """What the control server asks of the supervisor: a snapshot, and its log."""

    def __init__(self):
        self.logged = []

    def snapshot(self):
        return {"supervisor": {"state": "serving"}, "processes": []}

    def log(self, event, level="info", **fields):
        self.logged.append((event, level, fields))


@pytest.fixture
def server(tmp_path):
    loop = Loop(on_item=lambda item: None)
    s = control.ControlServer(str(tmp_path / "control.sock"), Supervisor(), loop)
    yield s
    s.close()
    loop.close()


def ask(server, data: bytes, pause: float = 0.0) -> dict | None:
    """Send `data` (then, after `pause` s, end the request) while the server takes the connection;
    its answer, or None when it hung up before the client finished."""
    answer = []

    def client():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(server.path)
            try:
                sock.sendall(data)
                time.sleep(pause)
                sock.shutdown(socket.SHUT_WR)
                answer.append(json.loads(sock.makefile().readline()))
            except (OSError, ValueError):
                pass

    thread = threading.Thread(target=client)
    thread.start()
    deadline = time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:
        server.loop.once(0.01)
    thread.join()
    return answer[0] if answer else None


@pytest.mark.parametrize("data,error", [
    (b"[1]\n", "Expected `object`, got `array`"),
    (b"[" * 5000 + b"\n", "Expected `object`, got `array`"),
    (b'{"cmd": "ps"', "bad request"),
    (b"\xff\xfe\x00\n", "bad request"),
    (b'{"cmd": ["ps"]}\n', "Expected `str`, got `array` - at `$.cmd`"),
    (b'{"cmd": "reboot"}\n', "Invalid enum value 'reboot' - at `$.cmd`"),
    (b"x" * (control.MAX_REQUEST_BYTES + 1) + b"\n", f"longer than {control.MAX_REQUEST_BYTES} bytes"),
], ids=["list", "deep", "truncated", "not-utf8", "wrong-cmd", "unknown-cmd", "too-long"])
def test_no_command_is_answered_and_logged(server, data, error):
    assert error in ask(server, data)["error"]
    assert [(e, level, f["socket"]) for e, level, f in server.supervisor.logged] == [
        ("dropped malformed message", "warning", "control")]
    assert error in server.supervisor.logged[0][2]["error"]
    assert ask(server, b'{"cmd": "ps"}\n')["supervisor"] == {"state": "serving"}  # and it serves on


def test_an_endless_request_is_cut_at_the_size_limit(server):
    assert ask(server, b"x" * (8 << 20)) is None  # cut off mid-send: the client sees the hang-up
    assert "longer than" in server.supervisor.logged[0][2]["error"]


def test_a_trickling_client_holds_nothing_up_and_is_cut_at_the_timeout(server, monkeypatch):
    monkeypatch.setattr(control, "REQUEST_TIMEOUT_S", 0.5)
    sent = []

    def trickle():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(server.path)
            for _ in range(300):  # a byte every 0.1 s for 30 s: each recv gets one well within any timeout
                try:
                    sock.sendall(b" ")
                except OSError:
                    break
                sent.append(1)
                time.sleep(0.1)

    thread = threading.Thread(target=trickle)
    thread.start()
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        server.loop.once(0.01)
    assert ask(server, b'{"cmd": "ps"}\n')["supervisor"] == {"state": "serving"}  # answered meanwhile,
    assert not server.supervisor.logged  # before the trickler's timeout
    while not server.supervisor.logged and time.monotonic() < deadline:
        server.loop.once(0.01)
    assert "no whole line within 0.5 s" in server.supervisor.logged[0][2]["error"]
    thread.join()
    assert len(sent) < 300  # hung up on mid-trickle: the supervisor went on without waiting for it
