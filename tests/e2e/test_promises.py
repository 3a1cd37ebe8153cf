"""README promises of `vsup serve` over the real engine (the tiny model), each shown with real processes:
a taken port and a name already served are refused before anything starts; `ps`, `logs`, `stop` and
`--help` never import torch; systemd hears READY=1 once it serves and STOPPING=1 on stop; SIGINT
drains like SIGTERM; a stop that needs SIGKILL says so and exits 1; a drain that runs out cuts what
is left and still stops cleanly.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import psutil
import pytest

from tests.conftest import held_shm
from tests.e2e.served import VSUP, Served, complete
from tests.polling import wait_for


@pytest.fixture(scope="module")
def live(model, tmp_path_factory):
    """One deployment that the tests which only look at it share."""
    s = Served(tmp_path_factory.mktemp("promises"), model, name="same")
    s.wait_serving()
    yield s
    s.kill()


def gone(pids) -> bool:
    return not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def streaming(s: Served, n: int):
    """One greedy stream of `n` tokens in a thread; returns (thread, chunks seen, outcome)."""
    seen, outcome = [], {}

    def run():
        try:
            for chunk in s.client.completions.create(model="tiny", prompt="a long story", max_tokens=n, stream=True,
                                                     temperature=0, extra_body={"ignore_eos": True}):
                if chunk.choices:
                    seen.append(chunk.choices[0].text)
            outcome["done"] = True
        except Exception as e:  # noqa: BLE001 - the outcome is the assertion
            outcome["error"] = e
    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: seen, timeout=120, what="the stream under way")
    return thread, seen, outcome


def test_a_taken_port_is_refused_before_anything_starts(model, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run([*VSUP, "serve", model, "--port", str(port), "--device", "cpu"], capture_output=True,
                                text=True, timeout=120, env={**os.environ, "VSUP_HOME": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert f"--port {port}" in result.stderr and "choose another --port" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "default").exists()  # nothing started


def test_a_second_serve_of_a_name_already_served_is_refused_and_the_first_serves_on(live, model):
    first = live.ps()["supervisor"]["pid"]
    second = Served(live.home, model, name=live.name)  # (on a port of its own)
    code, err = second.proc.wait(timeout=120), second.proc.stderr.read()
    assert code == 2, err
    assert f"deployment 'same' is already served by pid {first}" in err and "vsup stop --name same" in err
    state = live.wait_serving()
    assert state["supervisor"]["pid"] == first and complete(live.client, "hello", n=4)


@pytest.mark.parametrize("args", [["ps", "--json"], ["logs", "--role", "worker"], ["ps", "--help"], ["--help"],
                                  ["stop", "--help"], ["logs", "--help"]])
def test_ps_logs_stop_and_help_never_import_torch(live, args):
    """They are what an operator runs while the GPUs are busy or a deployment is in trouble."""
    code = (f"import sys; sys.argv = ['vsup', *{args!r}, *(['--name', 'same'] if '--help' not in {args!r} else [])]\n"
            "from vsup.cli.main import run\n"
            "try:\n    run()\nexcept SystemExit as e:\n    code = e.code\n"
            "heavy = [m for m in ('torch', 'transformers', 'engine', 'zmq') if m in sys.modules]\n"
            "print('HEAVY', heavy, 'EXIT', code, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "VSUP_HOME": live.home})
    assert "HEAVY [] EXIT 0" in result.stderr or "HEAVY [] EXIT None" in result.stderr, result.stderr
    assert result.stdout.strip()  # it did its job: a tree, lines, or the help


def test_systemd_hears_ready_once_serving_and_sigint_drains_a_running_request(model, tmp_path):
    """Under systemd (Type=notify) READY=1 means /health answers; Ctrl-C stops like SIGTERM: the stream
    running at that moment gets every token, then STOPPING=1, exit 0, nothing left."""
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(180)
        s = Served(tmp_path, model, env={"NOTIFY_SOCKET": path})
        try:
            assert sock.recv(64) == b"READY=1"
            assert s.ps()["supervisor"]["state"] == "serving"
            reference = complete(s.client, "a long story", n=200)
            pids = list(s.pids().values())
            thread, seen, outcome = streaming(s, 200)
            s.proc.send_signal(signal.SIGINT)
            assert sock.recv(64) == b"STOPPING=1"
            thread.join(timeout=120)
            code, _, err = s.stop()
        finally:
            s.kill()
    assert code == 0, err
    assert outcome == {"done": True} and "".join(seen) == reference  # it ran to its end
    assert gone(pids)
    assert not [n for n in set(os.listdir("/dev/shm")) - held_shm() if n.startswith("vsup-e2e-")]


def test_a_stop_that_needs_sigkill_says_so_and_exits_1(serve):
    """A worker that does not answer SIGTERM (stopped here) is killed after --stop-timeout; the stop is not
    a clean one, and systemd must hear so."""
    s = serve("--stop-timeout", "2")
    pids = s.wait_serving() and s.pids()
    os.kill(pids["worker dp0 pp0 tp0"], signal.SIGSTOP)
    code, _, err = s.stop()
    assert code == 1, err
    assert "stop needed SIGKILL for" in err and "worker dp0 pp0 tp0" in err and "--stop-timeout 2 s" in err
    assert gone(pids.values())


def test_a_drain_that_runs_out_cuts_the_rest_and_still_stops_cleanly(serve):
    """--drain-timeout bounds how long a stop waits for requests: a stream longer than it is cut, and the
    API server exits on its own (no SIGKILL: exit 0)."""
    s = serve("--drain-timeout", "0.2", "--stop-timeout", "20")
    s.wait_serving()
    pids = list(s.pids().values())
    thread, seen, outcome = streaming(s, 230)  # a step of the engine each: seconds, on these cores
    s.proc.send_signal(signal.SIGTERM)
    thread.join(timeout=120)
    code, _, err = s.stop()
    assert code == 0, err
    assert "error" in outcome or len(seen) < 230, (len(seen), outcome)  # cut, not run to its end
    assert "SIGKILL" not in err and gone(pids)
