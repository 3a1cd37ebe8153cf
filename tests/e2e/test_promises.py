"""The promises of docs/operating.md for `vsup serve` over the real engine (the tiny model), each shown with
real processes: a taken port and a name already served are refused before anything starts; `ps`, `logs`,
`stop` and `--help` never import torch; systemd hears READY=1 once it serves and STOPPING=1 on stop; SIGINT
drains like SIGTERM; a stop ends the API servers, the coordinator, then the engine cores and their
workers; a stop that needs SIGKILL says so and exits 1; a drain that runs out cuts what
is left and still stops cleanly; an API server's death costs only its own connections; a rank past
--max-restarts is routed around; `vsup restart --role worker --dp 0` loses nothing.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import held_shm
from tests.e2e.served import (VSUP, Served, Streams, assert_gave_up, complete, complete_all, kill_until_it_gives_up,
                              mid_stream)
from tests.polling import wait_for

LONG = 200  # tokens a stream that a fault must hit: the tiny model makes 48 in half a second


@pytest.fixture(scope="module")
def live(model, tmp_path_factory):
    """One deployment that the tests which only look at it share."""
    s = Served(tmp_path_factory.mktemp("promises"), model, name="same")
    s.wait_serving()
    yield s
    s.kill()


def gone(pids) -> bool:
    return not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


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


def test_only_the_workers_load_torch(live):
    """An engine core (or an API server) that restarts is back in under a second of imports, not the 2-3 s
    of torch's: the model runs in the workers alone, so only they load it."""
    assert complete(live.client, "hello", n=4)
    maps = {name: Path(f"/proc/{pid}/maps").read_text() for name, pid in live.pids().items()}
    assert [name for name, text in maps.items() if "libtorch" in text] == [n for n in maps if n.startswith("worker")]


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
            stream = Streams(s.client, ["a long story"], n=200)
            wait_for(stream.running, timeout=120, what="the stream under way")
            s.proc.send_signal(signal.SIGINT)
            assert sock.recv(64) == b"STOPPING=1"
            texts = stream.texts(timeout=120)
            code, _, err = s.stop()
        finally:
            s.kill()
    assert code == 0, err
    assert texts == [reference]  # it ran to its end, with no error
    assert gone(pids)
    assert not [n for n in set(os.listdir("/dev/shm")) - held_shm() if n.startswith("vsup-e2e-")]


def test_a_stop_ends_the_api_servers_then_the_coordinator_then_the_cores_and_their_workers(serve):
    """Requests drain at the API servers first, then the coordinator goes, then the engine cores, each of
    which tells its own workers to exit as it stops (so a worker may leave a moment before its core)."""
    s = serve("-dp", "2", "-tp", "2", "--api-server-count", "2", "--dp-lockstep")
    s.wait_serving()
    pids = s.pids()
    code, out, err = s.stop()
    assert code == 0, err
    stopped = [r["process"] for r in map(json.loads, out.splitlines()) if r.get("event") == "process stopped"]
    assert sorted(stopped) == sorted(pids), stopped  # each one, once
    order = {"api-server": 0, "coordinator": 1, "engine-core": 2, "worker": 2}
    ranks = [order[name.split()[0]] for name in stopped]
    assert ranks == sorted(ranks), stopped
    assert gone(pids.values())


def test_a_stop_that_needs_sigkill_says_so_and_exits_1(serve):
    """A worker that does not answer SIGTERM (stopped here) is killed after --stop-timeout; the stop is not
    a clean one, and systemd must hear so."""
    s = serve("--stop-timeout", "2")
    s.wait_serving()
    pids = s.pids()
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
    stream = Streams(s.client, ["a long story"], n=230)  # a step of the engine each: seconds, on these cores
    wait_for(stream.running, timeout=120, what="the stream under way")
    s.proc.send_signal(signal.SIGTERM)
    for t in stream.threads:
        t.join(timeout=120)
    code, _, err = s.stop()
    assert code == 0, err
    assert stream.errors or len(stream.chunks[0]) < 230, (len(stream.chunks[0]), stream.errors)  # cut
    assert "SIGKILL" not in err and gone(pids)


def test_an_api_servers_death_restarts_it_alone_and_drops_only_its_own_connections(serve):
    """Two API servers share the port: kill -9 of one under 16 streams restarts it alone; the streams the
    other held complete with the fault-free text, those of the dead one fail, and then all serve again."""
    s = serve("--api-server-count", "2")
    s.wait_serving()
    prompts = [f"the {i} way" for i in range(16)]
    reference = complete_all(s.client, prompts, n=LONG)
    # one API server's accept loop may take every connection that waits at once: more batches of the
    # same streams until each server holds some (the busy one tends to leave the next to the other)
    batches, held = [], {}
    while len(batches) < 4 and not (held and all(held.values())):
        batches.append(Streams(s.client, prompts, n=LONG))
        mid_stream(batches[-1], "the kill of api-server a1")
        held = client_connections(s, ["api-server a0", "api-server a1"])
    assert all(held.values()), f"every stream's connection went to one API server: {held}"
    os.kill(s.pids()["api-server a1"], signal.SIGKILL)
    for streams in batches:
        streams.join(timeout=300)
    kept = [(b, i) for b, streams in enumerate(batches) for i in range(len(prompts)) if i not in streams.errors]
    assert kept and all("".join(batches[b].chunks[i]) == reference[i] for b, i in kept), \
        [streams.errors for streams in batches]
    assert any(streams.errors for streams in batches), "no stream failed: a1 held none of the connections"
    state = s.wait_serving()
    assert {p["name"]: p["restarts"] for p in state["processes"] if p["restarts"]} == {"api-server a1": 1}
    assert complete_all(s.client, prompts, n=LONG) == reference
    assert s.stop()[0] == 0


def client_connections(s: Served, names: list[str]) -> dict[str, int]:
    """How many of this test process's connections to the deployment's port each of these processes holds."""
    ours = {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == s.port}
    pids = s.pids()
    return {name: sum(1 for c in psutil.Process(pids[name]).net_connections("tcp")
                      if c.laddr and c.laddr.port == s.port and c.raddr and c.raddr.port in ours)
            for name in names}


def send_completion(port: int, prompt: str) -> http.client.HTTPConnection:
    """A connection made and a completion request sent on it; its answer is read later (`answer`)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn


def answer(conn: http.client.HTTPConnection) -> str:
    response = conn.getresponse()
    assert response.status == 200, (response.status, response.read())
    return json.loads(response.read())["choices"][0]["text"]


def taken(pid: int, port: int, conns) -> set[int]:
    """Which of these connections (by client port) the process holds: it accepted them."""
    mine = {conn.sock.getsockname()[1] for conn in conns}
    return {c.raddr.port for c in psutil.Process(pid).net_connections("tcp")
            if c.laddr.port == port and c.raddr and c.raddr.port in mine}


def test_waiting_connections_outlive_an_api_servers_death_and_a_restarted_one_takes_them_only_when_ready(serve):
    """The API servers serve one socket that the supervisor holds. All frozen, 8 requests are sent: their
    connections wait in its queue, none accepted. kill -9 of a1 resets none of them (an API server with a
    socket of its own took those waiting for it along); a0, thawed, takes them all. The new a1 takes none
    while its engine core is frozen (it would answer them 503), and all 8 get the fault-free text once the
    core is thawed; then, a0 frozen again, a1 alone serves a new connection."""
    s = serve("--api-server-count", "2")
    s.wait_serving()
    prompts = [f"the {i} way" for i in range(8)]
    reference = complete_all(s.client, prompts)
    pids = s.pids()
    core, a0, old = pids["engine-core dp0"], pids["api-server a0"], pids["api-server a1"]

    def new_a1_waits_for_its_core():
        pid = s.pids().get("api-server a1")
        records = [json.loads(line) for line in s.vsup("logs", "--json", "--role", "api-server").stdout.splitlines()]
        return pid != old and any(r["pid"] == pid and r["event"] == "waiting for engine cores" for r in records) and pid
    for pid in (core, a0, old):
        os.kill(pid, signal.SIGSTOP)
    try:
        conns = [send_completion(s.port, prompt) for prompt in prompts]  # queued: nobody accepts
        assert not taken(a0, s.port, conns) and not taken(old, s.port, conns)
        os.kill(old, signal.SIGKILL)
        a1 = wait_for(new_a1_waits_for_its_core, 60, "the new api-server a1 waiting for its engine core")
        os.kill(a0, signal.SIGCONT)
        wait_for(lambda: len(taken(a0, s.port, conns)) == len(conns), 30, "a0 taking the 8 waiting connections")
        assert not taken(a1, s.port, conns)
        assert {p["name"]: p["state"] for p in s.ps()["processes"]}["api-server a1"] != "ready"
    finally:
        for pid in (a0, core):
            os.kill(pid, signal.SIGCONT)
    assert [answer(conn) for conn in conns] == reference
    for conn in conns:
        conn.close()
    wait_for(lambda: {p["name"]: p["state"] for p in s.ps()["processes"]}["api-server a1"] == "ready", 60,
             "a1 ready once its core is back")
    os.kill(a0, signal.SIGSTOP)
    try:
        conn = send_completion(s.port, prompts[0])
        assert answer(conn) == reference[0] and taken(a1, s.port, [conn])
        conn.close()
    finally:
        os.kill(a0, signal.SIGCONT)
    assert s.stop()[0] == 0


def test_connections_made_while_the_only_api_server_restarts_wait_for_the_new_one(serve):
    """One API server, frozen: 4 requests are sent, their connections wait in the supervisor's socket. kill -9
    of it: the new one takes them, and each gets the fault-free text (no refusal, no reset)."""
    s = serve()
    s.wait_serving()
    prompts = [f"the {i} way" for i in range(4)]
    reference = complete_all(s.client, prompts)
    old = s.pids()["api-server a0"]
    os.kill(old, signal.SIGSTOP)
    conns = [send_completion(s.port, prompt) for prompt in prompts]
    assert not taken(old, s.port, conns)
    os.kill(old, signal.SIGKILL)
    assert [answer(conn) for conn in conns] == reference
    for conn in conns:
        conn.close()
    state = s.wait_serving()
    assert {p["name"]: p["restarts"] for p in state["processes"] if p["restarts"]} == {"api-server a0": 1}
    assert s.stop()[0] == 0


def test_a_rank_past_max_restarts_is_marked_failed_and_routed_around(serve):
    s = serve("-dp", "2", "--max-restarts", "0")
    s.wait_serving()
    prompts = [f"the {i} way" for i in range(8)]
    reference = complete_all(s.client, prompts)
    os.kill(s.pids()["engine-core dp1"], signal.SIGKILL)
    units = wait_for(lambda: (state := s.ps()) and state["units"]["engine-core dp1"]["state"] == "failed"
                     and state["units"], timeout=60, what="engine-core dp1 marked failed")
    assert [name for name, unit in units.items() if unit["state"] == "failed"] == ["engine-core dp1"], units
    health = httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=5).json()  # (from state.json: at once)
    assert health["status"] == "degraded" and health["up"] == [0] and health["failed"] == [1]
    assert health["message"] == "dp1 failed" and "--max-restarts" in health["dp_ranks"]["1"]["error"]
    assert complete_all(s.client, prompts) == reference  # dp0 serves them all
    assert s.ps()["supervisor"]["state"] == "serving"
    assert s.stop()[0] == 0


def test_a_worker_killed_each_time_it_is_back_gives_up_naming_its_unit_and_leaves_nothing(serve):
    """With one DP rank, a worker group past --max-restarts leaves nothing to serve: `vsup serve` exits 1,
    saying which unit gave up and why, quoting its last stderr, with every process gone."""
    s = serve("--max-restarts", "2")
    s.wait_serving()
    before = s.pids()
    code, _, err, killed = kill_until_it_gives_up(s, "worker dp0 pp0 tp0", timeout=300)
    assert code == 1 and len(killed) == 3, (code, killed, err)
    assert_gave_up(err, "worker-group dp0 gave up: 2 restarts within 300 s (last exit: worker dp0 pp0 tp0 "
                        "signal 9 (SIGKILL))")
    assert gone([*before.values(), *killed])


def test_restart_of_a_worker_by_hand_drains_first_and_loses_nothing(serve):
    """`vsup restart --role worker --dp 0` under 8 streams: the core finishes its running requests, then
    the worker group restarts (exit 0, counted), and every stream completes with the fault-free text."""
    s = serve()
    s.wait_serving()
    prompts = [f"the {i} way" for i in range(8)]
    reference = complete_all(s.client, prompts, n=LONG)
    before = s.pids()["worker dp0 pp0 tp0"]

    def restart(streams):
        mid_stream(streams, "vsup restart")
        result = s.vsup("restart", "--role", "worker", "--dp", "0")
        assert result.returncode == 0, result.stderr
    assert complete_all(s.client, prompts, n=LONG, during=restart) == reference

    def restarted():
        worker = next(p for p in s.ps()["processes"] if p["name"] == "worker dp0 pp0 tp0")
        return worker["restarts"] == 1 and worker["state"] == "ready" and worker
    worker = wait_for(restarted, timeout=60, what="the worker group restarted")
    assert worker["pid"] != before and worker["last_exit"] == "exit 0"
    events = [json.loads(line) for line in s.vsup("logs", "--json").stdout.splitlines()]
    said = [r["event"] for r in events if r["event"] in ("draining", "drained", "restarting gracefully")]
    assert said[:3] == ["draining", "drained", "restarting gracefully"], said  # drained, then restarted
    assert s.stop()[0] == 0


def sample(scrape: str, name: str) -> float | None:
    """The value of one sample (`name` with its labels, as exposed) in a /metrics text."""
    return next((float(line.rpartition(" ")[2]) for line in scrape.splitlines()
                 if line.rpartition(" ")[0] == name), None)


def test_restart_of_the_api_servers_drains_one_at_a_time_and_fails_nothing(serve):
    """`vsup restart --role api-server` with two API servers under 16 streams: each stops taking
    connections, finishes its own streams and restarts (exit 0, counted), the second only once the first
    is back, so the port always has a listener; every stream completes with the fault-free text. And
    /metrics, whichever API server answers, counts every request of both, those before the restart too."""
    s = serve("--api-server-count", "2")
    s.wait_serving()
    prompts = [f"the {i} way" for i in range(16)]
    reference = complete_all(s.client, prompts, n=LONG)
    before = s.pids()

    def restart(streams):
        mid_stream(streams, "vsup restart")
        result = s.vsup("restart", "--role", "api-server")
        assert result.returncode == 0 and "api-server a0, api-server a1" in result.stdout, result.stderr
    assert complete_all(s.client, prompts, n=LONG, during=restart) == reference

    def restarted():
        servers = [p for p in s.ps()["processes"] if p["role"] == "api-server"]
        return all(p["restarts"] == 1 and p["state"] == "ready" for p in servers) and servers
    for server in wait_for(restarted, timeout=120, what="both API servers restarted"):
        assert server["last_exit"] == "exit 0" and server["pid"] != before[server["name"]]
    events = [json.loads(line) for line in s.vsup("logs", "--role", "supervisor", "--json").stdout.splitlines()]
    order = [(r["event"], r.get("process")) for r in events if r["event"] in ("restarting gracefully", "ready")
             and str(r.get("process")).startswith("api-server")]
    assert order[-4:] == [("restarting gracefully", "api-server a0"), ("ready", "api-server a0"),
                          ("restarting gracefully", "api-server a1"), ("ready", "api-server a1")], order
    for _ in range(4):  # a new connection each: the kernel hands each to either API server
        scrape = httpx.get(f"{s.url}/metrics", headers={"Connection": "close"}, timeout=30).text
        assert sample(scrape, 'vsup_requests_finished_total{finish_reason="length"}') == 2 * len(prompts)
        assert sample(scrape, "vsup_generation_tokens_total") == 2 * len(prompts) * LONG
    assert len(complete_all(s.client, prompts[:4], n=8)) == 4  # and serving after
    assert s.stop()[0] == 0
