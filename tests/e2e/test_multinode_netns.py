"""Nodes as separate hosts: each node's `vsup serve` in a network namespace of its own, on a LAN a test can unplug.

What loopback (test_multinode.py, the fast path) cannot show: the head and its headless node meet only
over the LAN (tests/e2e/netns.py), so a cut link is a partition in which no process dies and the head
learns of it only from heartbeats that stop; a node can be killed whole, every process in its
namespace; and a TP group spanning nodes runs its gloo traffic over the link (which found gloo
listening on loopback, where the host's name resolves).

Cost, shared on purpose: one head (-dp 2: API server, coordinator, dp0) serves the whole module and
computes the fault-free tokens once, with dp0 alone. Each DP test starts its own headless node for dp1
and stops it, so every test begins from a head whose dp1 is unknown or down and waits for its own
node's core to join: none depends on another's leftovers, at a node's start (a few seconds) per test
instead of a whole deployment's. The module takes about 2.5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import httpx
import pytest

from tests.e2e.netns import lan_for_a_test
from tests.e2e.served import Served, Streams, complete_all
from tests.polling import wait_for

CLUSTER = {"VSUP_CLUSTER_SECRET": "netns-test-secret"}
DP_PORT, TP_PORT = 29550, 29500  # in the namespaces' own port space: nothing else is there
PROMPTS = [f"the {i} way" for i in range(8)]
DP = ("-dp", "2", "--api-server-count", "1")  # one API server: the head's /health counts all it holds per rank
SHORT, LONG = 24, 200  # LONG streams still run when a fault hits (prompt + LONG < --max-model-len 256)
# deployment names carry the pid: a supervisor that exits removes every /dev/shm ring of its name
HEAD, NODE, TP0, TP1 = (f"ns{os.getpid()}-{role}" for role in ("head", "node1", "tp0", "tp1"))


@pytest.fixture(scope="module")
def lan():
    """The head's namespace (node 0) and one other node's (node 1) on one bridge; gone afterwards."""
    yield from lan_for_a_test(2)


@pytest.fixture(scope="module")
def head(lan, model, tmp_path_factory):
    """The head for the whole module, in node 0: API server (at the head's LAN address), coordinator, dp0."""
    s = Served(tmp_path_factory.mktemp("head-home"), model, *DP, "--dp-size-local", "1", "--dp-address",
               f"{lan.address(0)}:{DP_PORT}", name=HEAD, host=lan.address(0), prefix=lan.exec(0), env=CLUSTER)
    try:
        s.wait_serving()
        yield s
        assert s.stop()[0] == 0
    finally:
        s.kill()


@pytest.fixture(scope="module")
def reference(head):
    """{n: texts} that dp0 alone serves (no node has joined yet): the fault-free tokens."""
    texts = {n: complete_all(head.client, PROMPTS, n=n) for n in (SHORT, LONG)}
    assert all(texts[SHORT]) and all(texts[LONG]), texts
    return texts


def start_node(serve, lan):
    """A headless node in node 1's namespace: dp1's engine core and worker, joining the head over the LAN."""
    return serve(*DP, "--headless", "--dp-start-rank", "1", "--dp-address", f"{lan.address(0)}:{DP_PORT}",
                 name=NODE, prefix=lan.exec(1), env=CLUSTER)


def health(s):
    return httpx.get(f"{s.url}/health", timeout=5).json()


def wait_health(head, what, timeout, **expected):
    """The head's /health once each field in `expected` has its value."""
    def matches():
        body = health(head)
        return body if all(body.get(k) == v for k, v in expected.items()) else None
    return wait_for(matches, timeout, what)


def wait_joined(head, node) -> int:
    """The head routes to this node's dp1; its engine core's pid. Known by that pid: the core of a node
    stopped a moment ago looks up for a few seconds more."""
    node.wait_serving()
    core = node.pids()["engine-core dp1"]

    def joined():
        body = health(head)
        return body["up"] == [0, 1] and body["dp_ranks"]["1"]["pid"] == core
    wait_for(joined, 90, f"dp1 (engine core pid {core}) never joined the head", now=lambda: health(head))
    return core


def streams_on_dp1(head):
    """LONG greedy streams, returned once every one has streamed text and dp1 runs some of them."""
    streams = Streams(head.client, PROMPTS, n=LONG)
    wait_for(lambda: streams.all_streaming() and health(head)["dp_ranks"]["1"]["num_in_flight"] > 0, 60,
             "the streams never ran on dp1")
    return streams


def held_on_dp1(head, streams) -> int:
    """Right after a fault: how many requests dp1 held (the head counts unfinished ones only, and has not
    noticed yet); AssertionError unless there were some, each midway through its stream."""
    held = health(head)["dp_ranks"]["1"]["num_in_flight"]
    assert held > 0 and len(streams.running()) >= held, f"dp1 held {held}, running {streams.running()}"
    return held


def moved_from_dp1(head) -> int:
    """How many requests the head has moved off an unresponsive dp1 so far, by its log."""
    with open(os.path.join(head.home, HEAD, "logs", "vsup.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.endswith("\n")]  # not one being written
    return sum(r["num_requests"] for r in lines
               if r.get("event") == "engine core unresponsive; moving its requests" and r.get("dp_rank") == 1)


def takes_requests(head, reference):
    """Both ranks step for a round of requests, which come back with the fault-free tokens."""
    before = head.settled_counters()
    assert complete_all(head.client, PROMPTS, n=SHORT) == reference[SHORT]
    after = head.settled_counters()
    assert all(after[r][2] > before.get(r, (0, 0, 0))[2] for r in (0, 1)), (before, after)


def test_dp_across_namespaces_serves_what_one_node_serves(head, serve, lan, reference):
    node = start_node(serve, lan)
    wait_joined(head, node)
    ps = {p["name"]: p for p in head.ps()["processes"]}
    assert ps["engine-core dp1"]["state"] == "remote: ready" and ps["worker dp1 pp0 tp0"]["node"] == 1
    assert [p["name"] for p in node.ps()["processes"]] == ["engine-core dp1", "worker dp1 pp0 tp0"]
    assert health(head)["status"] == "ok"
    takes_requests(head, reference)
    assert node.stop()[0] == 0


@pytest.mark.parametrize("drop", [False, True], ids=["cable-pulled", "frames-dropped"])
def test_a_partition_moves_dp1s_requests_and_heals_when_the_link_is_back(head, serve, lan, reference, drop):
    """A partition is no death: every process runs on, and the head learns of it only as heartbeats stop.
    Pulled, node 1's own link loses its carrier; dropped, no kernel notices and TCP only times out."""
    node = start_node(serve, lan)
    core = wait_joined(head, node)
    moved = moved_from_dp1(head)
    streams = streams_on_dp1(head)
    lan.unplug(1, drop=drop)
    try:
        held = held_on_dp1(head, streams)
        body = wait_health(head, "the head never noticed dp1 was cut off", 30, down=[1])
        assert body["status"] == "degraded" and body["up"] == [0] and body["message"] == "dp1 down"
        assert streams.texts() == reference[LONG]  # finished on dp0 while dp1 is still cut off
        wait_for(lambda: moved_from_dp1(head) - moved == held, 10, "the head's log does not say it moved them")
        assert node.proc.poll() is None  # a partition is no death: the node's supervisor saw nothing
    finally:
        lan.plug(1)
    body = wait_health(head, "dp1 did not come back with the link", 90, up=[0, 1])
    assert body["status"] == "ok" and body["dp_ranks"]["1"]["pid"] == core  # the same core, back
    takes_requests(head, reference)
    assert {p["name"]: p["restarts"] for p in node.ps()["processes"]} == {
        "engine-core dp1": 0, "worker dp1 pp0 tp0": 0}
    assert node.stop()[0] == 0


def test_a_node_killed_whole_is_routed_around_and_rejoins_when_started_again(head, serve, lan, reference):
    node = start_node(serve, lan)
    wait_joined(head, node)
    head_pids = head.pids()
    streams = streams_on_dp1(head)
    killed = lan.kill(1)  # every process in the node: its supervisor, engine core and worker at once
    assert len(killed) >= 3 and node.proc.wait(timeout=10) == -9
    held_on_dp1(head, streams)
    body = wait_health(head, "the head never noticed dp1 was gone", 30, down=[1])
    assert body["status"] == "degraded" and body["message"] == "dp1 down"
    assert streams.texts() == reference[LONG]

    again = start_node(serve, lan)  # the node comes back: a new vsup serve, same flags and name
    wait_joined(head, again)
    assert health(head)["status"] == "ok"
    takes_requests(head, reference)
    assert head.pids() == head_pids  # the head was never restarted
    assert again.stop()[0] == 0


def store_clients(lan) -> set[str]:
    """Node 1's open connections to the rendezvous store (tp0's, in node 0), as address:port; a dead
    client's is half-closed, not established."""
    out = subprocess.run([*lan.exec(0), "ss", "-Htn", "state", "established", f"( sport = :{TP_PORT} )"],
                         capture_output=True, text=True, check=True).stdout
    peers = (line.split()[-1].rsplit(":", 1) for line in out.splitlines())  # [::ffff:10.x.y.2]:40328 (dual-stack)
    return {f"{a}:{port}" for host, port in peers if (a := host.strip("[]").removeprefix("::ffff:")) == lan.address(1)}


def test_a_tp_group_spans_two_namespaces_and_heals_when_its_remote_worker_dies(serve, lan, reference):
    """-tp 2 --nnodes 2: tp0 and the engine core in node 0, tp1 in node 1; gloo, the steps and the
    results cross the LAN. tp1 is killed while tp0 is frozen (SIGSTOP): as on a loaded machine, the lost
    group's rank 0, which hosts the rendezvous store, outlives the kill by seconds, and tp1's replacement
    reaches that store first. It must wait there for its own generation (the epoch its core hands out),
    not join the dead group; and the late failure report of the old tp0 must not fail the new group."""
    group = ("-tp", "2", "--nnodes", "2", "--master-addr", lan.address(0), "--master-port", str(TP_PORT))
    node0 = serve(*group, name=TP0, host=lan.address(0), prefix=lan.exec(0), env=CLUSTER)
    node1 = serve(*group, "--node-rank", "1", "--headless", name=TP1, prefix=lan.exec(1), env=CLUSTER)
    node0.wait_serving()
    node1.wait_serving()
    ps = {p["name"]: p for p in node0.ps()["processes"]}
    assert ps["worker dp0 pp0 tp1"]["state"] == "remote: ready" and ps["worker dp0 pp0 tp1"]["node"] == 1
    assert complete_all(node0.client, PROMPTS, n=SHORT) == reference[SHORT]  # what TP = 1 on one node serves
    fault_free = complete_all(node0.client, PROMPTS, n=LONG)

    streams = Streams(node0.client, PROMPTS, n=LONG)
    wait_for(streams.all_streaming, 60, "the streams never began")
    tp0, tp1 = node0.pids()["worker dp0 pp0 tp0"], node1.pids()["worker dp0 pp0 tp1"]
    old_clients = store_clients(lan)
    os.kill(tp0, signal.SIGSTOP)
    try:
        os.kill(tp1, signal.SIGKILL)
        assert streams.running(), "every stream had ended before the kill: make them longer"
        wait_for(lambda: store_clients(lan) - old_clients, 60,
                 "tp1's replacement connected to the frozen tp0's rendezvous store")
    finally:
        os.kill(tp0, signal.SIGCONT)
    assert streams.texts() == fault_free
    # a replacement that met the old store fails once it goes, before it joined: restarted again
    assert node1.wait_serving()["processes"][0]["restarts"] in (1, 2)
    restarts = {p["name"]: p["restarts"] for p in node0.wait_serving()["processes"] if p.get("pid")}
    assert restarts["worker dp0 pp0 tp0"] == 1 and restarts["engine-core dp0"] == 0
    assert complete_all(node0.client, PROMPTS[:2], n=SHORT) == reference[SHORT][:2]  # the group is whole again
    assert node1.stop()[0] == 0 and node0.stop()[0] == 0
