"""The supervisor over real stand-in processes: tagging, ps, restarts by unit, stop, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.polling import wait_for

TREE = Path(__file__).parent / "fake" / "tree.py"
VSUP = [sys.executable, "-m", "vsup"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("VSUP_HOME", str(tmp_path))
    return tmp_path


def start(name, tp=2, dp=1, max_restarts=5, env=None):
    proc = subprocess.Popen([sys.executable, str(TREE), name, str(tp), str(dp), str(max_restarts)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    return proc


def vsup(*args):
    return subprocess.run([*VSUP, *args], capture_output=True, text=True, timeout=60)


def ps(name):
    result = vsup("ps", "--name", name, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def serving(name):
    def check():
        try:
            state = ps(name)
        except (AssertionError, json.JSONDecodeError):
            return None
        return state if state["supervisor"]["state"] == "serving" else None
    return wait_for(check, what="serving")


def tree_pids(state):
    return {p["name"]: p["pid"] for p in state["processes"]}


def stop(proc, timeout=30):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def test_ps_names_equal_plan_and_logs_are_tagged_by_pipe(home):
    proc = start("tags", tp=2, dp=2)
    try:
        state = serving("tags")
        plan = json.loads(vsup("plan", "--device", "cpu", "--json", "-tp", "2", "-dp", "2").stdout)
        assert [p["name"] for p in state["processes"]] == [p["name"] for p in plan["processes"]]
        assert all(p["state"] == "ready" and psutil.pid_exists(p["pid"]) for p in state["processes"])
        text = vsup("ps", "--name", "tags").stdout
        assert "worker dp1 pp0 tp1" in text and "serving" in text.splitlines()[0]

        lines = vsup("logs", "--name", "tags", "--role", "worker", "--tp", "1", "--dp", "0", "--json").stdout
        records = [json.loads(line) for line in lines.splitlines()]
        assert {r["name"] for r in records} == {"worker dp0 pp0 tp1"}
        events = [r["event"] for r in records]
        assert "native write from worker dp0 pp0 tp1" in events  # straight to fd 2
        assert "Traceback (most recent call last):" in events and "KeyError: 'missing'" in events
        ready = next(r for r in records if r["event"] == "ready")
        assert (ready["role"], ready["dp"], ready["stream"]) == ("worker", 0, "stdout")  # not the child's claim
        errors = vsup("logs", "--name", "tags", "--level", "error", "--json").stdout.splitlines()
        assert errors and all(json.loads(line)["level"] == "error" for line in errors)
    finally:
        code, out, err = stop(proc)
    assert code == 0, err
    assert "serving fake on http://127.0.0.1:1" in out


def test_dead_worker_restarts_its_whole_group_and_ps_counts_it(home):
    proc = start("heal", tp=2)
    try:
        before = tree_pids(serving("heal"))
        os.kill(before["worker dp0 pp0 tp1"], signal.SIGKILL)

        def healed():
            state = ps("heal")
            workers = [p for p in state["processes"] if p["role"] == "worker"]
            return state if all(p["state"] == "ready" and p["restarts"] == 1 for p in workers) else None
        after = tree_pids(wait_for(healed, what="worker group back"))
        assert after["worker dp0 pp0 tp0"] != before["worker dp0 pp0 tp0"]  # the whole group, not one rank
        assert after["engine-core dp0"] == before["engine-core dp0"]  # the core stays up
        assert after["api-server a0"] == before["api-server a0"]
        assert not psutil.pid_exists(before["worker dp0 pp0 tp0"])
        state = ps("heal")
        assert next(p for p in state["processes"] if p["name"] == "worker dp0 pp0 tp1")["last_exit"] == "signal 9 (SIGKILL)"
    finally:
        stop(proc)


def test_restart_now_takes_the_crash_path(home):
    proc = start("again", tp=1)
    try:
        before = tree_pids(serving("again"))
        result = vsup("restart", "--name", "again", "--role", "engine-core", "--dp", "0", "--now")
        assert result.returncode == 0 and "engine-core dp0" in result.stdout
        after = tree_pids(wait_for(lambda: (s := ps("again"))["supervisor"]["state"] == "serving" and all(
            p["state"] == "ready" and p["restarts"] == 1 for p in s["processes"] if p["role"] != "api-server") and s))
        assert after["engine-core dp0"] != before["engine-core dp0"]
        assert after["worker dp0 pp0 tp0"] != before["worker dp0 pp0 tp0"]  # a core brings its group along
        assert after["api-server a0"] == before["api-server a0"]
        assert vsup("restart", "--name", "again", "--role", "coordinator").returncode == 1  # there is none
    finally:
        stop(proc)


def test_a_restart_that_ends_during_the_stop_starts_nothing_again(home):
    """SIGTERM while `vsup restart --role worker` waits for its workers to exit: the stop reaches the workers
    last (after the API servers, which take 2 s here), so their restart ends first, and they must not be
    spawned again under a supervisor that is stopping."""
    proc = start("late", tp=1, env={"FAKE_LINGER": "api-server=2,worker=0.5"})
    try:
        serving("late")
        assert vsup("restart", "--name", "late", "--role", "worker").returncode == 0
        proc.send_signal(signal.SIGTERM)
        code, _, err = stop(proc)
    finally:
        stop(proc)
    assert code == 0, err  # (a worker spawned late loads while the stop waits, and needs its SIGKILL)
    records = [json.loads(line) for line in vsup("logs", "--name", "late", "--json").stdout.splitlines()]
    said = [(r["event"], r.get("process")) for r in records if r.get("name") == "supervisor"]
    stopping = said.index(("stopping", None))
    assert ("restarting gracefully", "worker-group dp0") in said[:stopping]
    assert ("process stopped", "worker dp0 pp0 tp0") in said[stopping:]  # the restart was under way
    assert ("started", "worker dp0 pp0 tp0") not in said[stopping:]


def test_a_process_quiet_at_its_start_is_named_with_what_it_said_last(home):
    """A worker that says nothing for 6.5 s before it is ready (a cold torch import, a kernel build): at 5 s of
    silence the supervisor names it, once, with its last line; the processes that are ready are not named."""
    proc = start("quiet", tp=1, env={"FAKE_QUIET": "worker=6.5"})
    try:
        serving("quiet")
    finally:
        code, _, err = stop(proc)
    assert code == 0, err
    records = [json.loads(line) for line in vsup("logs", "--name", "quiet", "--json").stdout.splitlines()]
    said = [r for r in records if r.get("name") == "supervisor" and r["event"] == "still starting"]
    assert [(r["process"], r["quiet_s"], r["last"]) for r in said] == \
        [("worker dp0 pp0 tp0", 5, "KeyError: 'missing'")]
    said_by_supervisor = [(r["event"], r.get("process")) for r in records if r.get("name") == "supervisor"]
    assert said_by_supervisor.index(("still starting", "worker dp0 pp0 tp0")) < \
        said_by_supervisor.index(("ready", "worker dp0 pp0 tp0"))  # while it started, not after


def test_the_probes_stay_live_through_a_restart_inside_and_ready_only_when_all_is(home):
    """The kubelet's view of a pod (--probe-port): /livez is 200 from the start to the end, through a worker's
    kill -9 and its group's restart (a failed liveness would have the kubelet restart the container, and a
    LeaderWorkerSet recreate the whole group); /readyz is 503 while a unit starts or restarts, 200 otherwise."""
    import httpx

    from tests.local_deployment import free_port

    port = free_port()
    proc = start("probed", tp=1, env={"FAKE_QUIET": "worker=2", "FAKE_PROBE_PORT": str(port)})
    seen = []

    def probe():
        live = httpx.get(f"http://127.0.0.1:{port}/livez", timeout=2)
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
        seen.append((live.status_code, ready.status_code, ready.text))
        return seen[-1]
    def starting():
        try:
            return proc.poll() is None and probe()[1] == 503
        except httpx.ConnectError:  # (not bound yet: its supervisor is still importing)
            return False
    try:
        wait_for(starting, what="the probes answering while it starts")
        assert "not ready: " in seen[-1][2] and "worker-group dp0" in seen[-1][2]
        wait_for(lambda: probe()[1] == 200, what="ready once serving")
        before = len(seen)
        os.kill(tree_pids(ps("probed"))["worker dp0 pp0 tp0"], signal.SIGKILL)
        wait_for(lambda: probe()[1] == 503, timeout=5, what="not ready while the worker group restarts")
        wait_for(lambda: probe()[1] == 200, what="ready again")
        assert httpx.get(f"http://127.0.0.1:{port}/nothing", timeout=2).status_code == 404
    finally:
        code, _, err = stop(proc)
    assert code == 0, err
    assert {live for live, _, _ in seen} == {200}  # live all along, through the restart
    assert [ready for _, ready, _ in seen[before:]].count(503) >= 1 and seen[-1][1] == 200
    with pytest.raises(httpx.ConnectError):  # the port went with the supervisor
        httpx.get(f"http://127.0.0.1:{port}/livez", timeout=2)


def test_liveness_fails_only_when_the_loop_stops_turning():
    import socket

    from vsup.supervisor.probes import STUCK_S, Probes

    probes = Probes(socket.socket())
    try:
        probes.publish(True, "serving")
        assert probes.answer("/livez") == (200, "ok\n") and probes.answer("/readyz") == (200, "ok\n")
        probes.beat -= STUCK_S
        assert probes.answer("/livez")[0] == 503 and probes.answer("/readyz") == (200, "ok\n")
        probes.publish(False, "restarting; not ready: worker-group dp0")
        assert probes.answer("/livez")[0] == 200
        assert probes.answer("/readyz") == (503, "restarting; not ready: worker-group dp0\n")
    finally:
        probes.server.server_close()


def test_a_head_is_given_up_only_after_it_answered_once_and_then_not_for_the_timeout():
    from vsup.supervisor.head_watch import head_lost

    assert not head_lost(None, 1000.0, 30.0)  # never answered: the node may have started before its head
    assert not head_lost(100.0, 130.0, 30.0) and head_lost(100.0, 130.1, 30.0)


def test_sigterm_stops_everything_and_cleans_up(home):
    proc = start("calm")
    pids = tree_pids(serving("calm"))
    code, out, err = stop(proc)
    assert code == 0, err
    assert not [pid for pid in pids.values() if psutil.pid_exists(pid)]
    run_dir = home / "calm"
    assert not list(run_dir.glob("*.sock"))
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"
    state = ps("calm")
    assert state["supervisor"]["live"] is False and state["supervisor"]["state"] == "stopped"
    assert "supervisor not running" in vsup("ps", "--name", "calm").stdout


def test_killed_supervisor_takes_the_tree_along(home):
    proc = start("orphans")
    pids = tree_pids(serving("orphans"))
    proc.kill()
    proc.wait()
    wait_for(lambda: not [pid for pid in pids.values() if psutil.pid_exists(pid) and
                          psutil.Process(pid).status() != psutil.STATUS_ZOMBIE],
             timeout=2.0, what="the tree gone within 2 s of its supervisor")
    proc.stdout.close()
    proc.stderr.close()


def test_always_crashing_worker_gives_up_naming_it(home):
    started = time.monotonic()
    proc = start("doomed", tp=1, max_restarts=2, env={"FAKE_CRASH": "worker"})
    code, out, err = proc.wait(timeout=60), proc.stdout.read(), proc.stderr.read()
    assert code == 1
    assert time.monotonic() - started < 30
    assert err.startswith("vsup serve: worker-group dp0 gave up: 2 restarts within 300 s (last exit: worker dp0 pp0 "
                          "tp0 exit 1)\n"), err
    assert "CUDA error: out of memory (simulated)" in err  # its last stderr lines, quoted
    assert out.count("restarting") == 2


def test_second_supervisor_with_the_same_name_is_refused(home):
    proc = start("twice")
    try:
        serving("twice")
        second = subprocess.run([sys.executable, str(TREE), "twice", "1", "1", "5"], capture_output=True,
                                text=True, timeout=30)
        assert second.returncode != 0 and f"already served by pid {proc.pid}" in second.stderr
    finally:
        stop(proc)


def test_unknown_deployment_exits_1(home):
    for command in ("ps", "logs", "stop"):
        result = vsup(command, "--name", "ghost")
        assert result.returncode == 1 and "no deployment named 'ghost'" in result.stderr


def test_a_worker_and_its_core_dead_in_one_select_are_each_handled_once(home):
    """A worker's exit is handled after its core's (the core's death is the cause): with both pidfds ready
    in one select, the worker first, the core's turn came again with its pidfd gone, and the stop ended
    in a traceback and exit 1. Real processes that have exited; the supervisor's own loop."""
    from tests.vsup.fake.tree import fake_plan
    from vsup.rundir import RunDir
    from vsup.supervisor.engine_units import EngineUnits
    from vsup.supervisor.log_router import LogRouter
    from vsup.supervisor.restart_policy import RestartPolicy
    from vsup.supervisor.supervisor import Options, Supervisor

    run_dir = RunDir("both")
    run_dir.create()
    records = []
    sup = Supervisor(run_dir, Options("/models/fake", "http://127.0.0.1:1", RestartPolicy("never")),
                     LogRouter([records.extend]), lambda s: EngineUnits(s, fake_plan(1, 1)))
    children = sup.adapter.children
    pair = [next(c for c in children if c.spec.name == name) for name in ("worker dp0 pp0 tp0", "engine-core dp0")]
    for child in pair:  # the worker exits first: epoll hands its pidfd over first
        child.popen = subprocess.Popen([sys.executable, "-c", ""])
        child.pidfd = os.pidfd_open(child.pid)
        sup.loop.watch(child.pidfd, lambda c=child: sup.adapter.exited(c))
        wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, what=f"{child.spec.name} exited")
    sup.state = "stopping"
    sup.loop.once(1)
    stopped = [r["process"] for r in records if r["event"] == "process stopped"]
    assert sorted(stopped) == ["engine-core dp0", "worker dp0 pp0 tp0"]
    assert all(sup.adapter.state_of(c) == "stopped" and c.last_exit == "exit 0" for c in pair)
    sup.control.close()
    sup.adapter.cleanup()


def test_ps_marks_a_process_that_outlived_its_supervisor_as_orphaned(home):
    """state.json of a supervisor that is gone: a process of its tree that still runs (its command line the
    one state.json has) is shown orphaned, as it may hold memory; a stranger who got a pid number is not."""
    from tests.vsup.stopped_deployment import stopped_deployment

    run_dir = stopped_deployment(home, "left")
    survivor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(61)"])
    try:
        state = json.loads(run_dir.state_file.read_text())
        worker, core = (next(p for p in state["processes"] if p["role"] == role) for role in ("worker", "engine-core"))
        worker.update(pid=survivor.pid, title=" ".join(survivor.args), state="ready")
        core.update(pid=stranger.pid, state="ready")  # its title is the core's, not the stranger's command line
        run_dir.write_state(state)
        shown = ps("left")
        assert shown["supervisor"]["live"] is False
        states = {p["name"]: p["state"] for p in shown["processes"]}
        assert states[worker["name"]] == "orphaned" and states[core["name"]] != "orphaned"
        assert "orphaned" in vsup("ps", "--name", "left").stdout
    finally:
        for proc in (survivor, stranger):
            proc.kill()
            proc.wait()


def test_ps_names_a_foreign_process_that_holds_memory_on_the_deployments_gpu(home, tmp_path):
    """Who is left holding GPU memory: NVML (a stand-in at the boundary: this host has no GPU) says a worker
    and a stranger hold memory on cuda:0; `vsup ps` gives the worker its memory and names the stranger."""
    holders = tmp_path / "holders.json"
    holders.write_text("[]")
    stranger = subprocess.Popen(["sleep", "60"])
    proc = start("gpu", tp=1, env={"FAKE_NVML_HOLDERS": str(holders)})
    try:
        worker = tree_pids(serving("gpu"))["worker dp0 pp0 tp0"]
        holders.write_text(json.dumps([[worker, 1536 << 20], [stranger.pid, 1 << 30]]))
        state = ps("gpu")
        row = next(p for p in state["processes"] if p["name"] == "worker dp0 pp0 tp0")
        assert row["device"] == "cuda:0" and row["device_memory_bytes"] == 1536 << 20
        assert state["gpu_others"] == [{"pid": stranger.pid, "gpu": 0, "bytes": 1 << 30, "cmdline": "sleep 60"}]
        text = vsup("ps", "--name", "gpu").stdout
        assert f"cuda:0 is also held by pid {stranger.pid} (sleep 60): 1.0 GiB" in text and "1.5 GiB" in text, text
    finally:
        stop(proc)
        stranger.kill()
        stranger.wait()
