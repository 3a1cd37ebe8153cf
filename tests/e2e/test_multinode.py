"""Two nodes on one machine: a head `vsup serve` and a `--headless` one, meeting over loopback TCP.

The head runs the API server, the coordinator and dp0; the headless node
runs dp1, whose engine core joins the head over tcp:// with CurveZMQ keys
from the cluster secret. Losing the node: the head serves on with dp0 and
/health names dp1; the node comes back: dp1 rejoins without touching the
head. A peer without the secret, or with another model, is refused and
the refusal is logged. And one TP group split over two nodes (--nnodes),
which heals when its worker on the other node dies.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import time

import httpx
import psutil
import pytest

from tests.e2e.served import complete, complete_all, mid_stream
from tests.local_deployment import with_test_tokenizer
from tests.polling import wait_for

SECRET = "loopback-test-secret"


def free_port_block(n: int = 5) -> int:
    """A port P with P..P+n-1 all free on 127.0.0.1 now, below the kernel's ephemeral range: there no client
    connection of another test takes one of them as its source port before the head binds it (the head's
    API server once failed its start 5 times in a row on such a port)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first_ephemeral = int(f.read().split()[0])
    for _ in range(100):
        base = random.randrange(max(1024, first_ephemeral - 12000), first_ephemeral - n)
        try:
            socks = []
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no block of free ports")


@pytest.fixture
def nodes(serve, model, monkeypatch):
    """nodes(role, *flags, secret=SECRET, model_dir=model) starts a head or a headless `vsup serve` (DP 2)."""
    dp_address = f"127.0.0.1:{free_port_block()}"

    def start(role, *flags, secret=SECRET, model_dir=model, name=None):
        monkeypatch.setenv("VSUP_CLUSTER_SECRET", secret)  # the environment, as an operator would
        common = ("-dp", "2", "--dp-address", dp_address)
        if role == "head":
            return serve(*common, "--dp-size-local", "1", *flags, name=name or "head", model_dir=model_dir)
        return serve(*common, "--headless", "--dp-start-rank", "1", *flags, name=name or "node1",
                     model_dir=model_dir)

    return start


def health(port):
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()


def test_a_headless_node_serves_leaves_and_rejoins(nodes):
    head = nodes("head")
    node = nodes("headless")
    head.wait_serving()
    node.wait_serving()
    wait_for(lambda: health(head.port)["up"] == [0, 1], 90, "dp1 never joined the head")

    ps = {p["name"]: p for p in head.ps()["processes"]}  # the head lists dp1 as remote, with its state
    assert ps["engine-core dp1"]["state"] == "remote: ready" and ps["worker dp1 pp0 tp0"]["node"] == 1
    assert ps["engine-core dp0"]["pid"] and ps["engine-core dp1"]["pid"] is None

    prompts = [f"the {i} way" for i in range(8)]
    n = 64  # (at 24 the decode loop in C++ finished every stream before the kill, now and then)
    reference = complete_all(head.client, prompts, n=n)
    served = head.settled_counters()
    assert served[0][0] > 0 and served[1][0] > 0  # both nodes stepped for requests

    # kill -9 the headless supervisor mid-generation: its tree dies with it; nothing is lost
    node_pids = list(node.pids().values())

    def lose_node(streams):
        mid_stream(streams, "the kill of the node")
        node.proc.kill()

    assert complete_all(head.client, prompts, n=n, during=lose_node) == reference
    node.proc.communicate()
    moved = [json.loads(line) for line in head.vsup("logs", "--role", "api-server", "--json").stdout.splitlines()]
    moved = [r for r in moved if r["event"] == "engine core unresponsive; moving its requests"]
    assert moved and all(r["dp_rank"] == 1 for r in moved), moved  # the kill hit requests running on the node
    wait_for(lambda: not [p for p in node_pids if psutil.pid_exists(p)
                          and psutil.Process(p).status() != psutil.STATUS_ZOMBIE], 10, "node left orphans")
    body = wait_for(lambda: (lambda h: h if h["down"] == [1] else None)(health(head.port)), 30,
                    "the head never noticed dp1 was gone")
    assert body["status"] == "degraded" and body["up"] == [0] and "dp1 down" in body["message"]
    assert complete(head.client, prompts[0], n=n) == reference[0]

    # the node comes back under the same name: dp1 rejoins and takes requests, the head untouched
    head_pids = head.pids()
    again = nodes("headless")
    again.wait_serving()
    body = wait_for(lambda: (lambda h: h if h["up"] == [0, 1] else None)(health(head.port)), 60,
                    "dp1 did not rejoin")
    assert body["status"] == "ok"
    before = head.settled_counters()[1][2]  # the new dp1's count of requests taken
    assert complete_all(head.client, prompts, n=n) == reference
    assert head.settled_counters()[1][2] > before  # dp1 took requests again
    assert head.pids() == head_pids

    pids = [pid for pid in (*head.pids().values(), *again.pids().values()) if pid]  # remote ones have none
    assert again.stop()[0] == 0 and head.stop()[0] == 0
    assert not [p for p in pids if psutil.pid_exists(p)]


def test_peers_without_the_secret_or_with_another_model_are_refused(nodes, tiny_model, tmp_path):
    head = nodes("head")
    head.wait_serving()
    stranger = nodes("headless", "--max-restarts", "0", secret="not-the-secret", name="stranger")
    other_model = str(with_test_tokenizer(tiny_model("llama"), tmp_path / "other-model"))
    impostor = nodes("headless", "--max-restarts", "0", model_dir=other_model, name="impostor")

    # the impostor knows the secret, so it gets to say Hello; its model differs: refused, it stops
    code, _, err = impostor.proc.wait(timeout=180), *impostor.proc.communicate()
    assert code == 1, err
    assert "refused by the API server" in err and "the plan or model differs: model:" in err
    assert "on the head node, other-model" in err  # the supervisor's message quotes its core's last error

    time.sleep(2)  # the stranger has been knocking (every ~100 ms) all along
    assert health(head.port)["up"] == [0] and health(head.port)["dp_ranks"]["1"]["state"] == "unknown"
    lines = [json.loads(line) for line in
             open(os.path.join(head.home, "head", "logs", "vsup.jsonl"), encoding="utf-8")]
    refusals = [r for r in lines if r.get("event") == "refused a peer"]
    assert any("another --cluster-secret" in r["reason"] for r in refusals), refusals
    impostors = [r for r in lines if r.get("event") == "refused engine core: its plan or model differs"]
    assert impostors and "tiny-with-tokenizer" in impostors[0]["differences"]
    assert complete(head.client, "hello", n=8)  # the head serves on, untouched

    # the stranger's core gives up and says why; nothing of it ever reached the head
    code, _, err = stranger.proc.wait(timeout=120), *stranger.proc.communicate()
    assert code == 1 and re.search(r"refused our handshake \d+ times in a row: is --cluster-secret", err), err
    assert health(head.port)["dp_ranks"]["1"]["state"] == "unknown"
    assert head.stop()[0] == 0


def test_a_tp_group_spans_two_nodes_and_heals_when_a_remote_worker_dies(serve, monkeypatch):
    """-tp 2 --nnodes 2: tp0 beside the engine core on node 0, tp1 on node 1, meeting over loopback TCP
    (torch.distributed at --master-port, the core's steps over CurveZMQ)."""
    monkeypatch.setenv("VSUP_CLUSTER_SECRET", SECRET)
    common = ("-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port_block(3)))
    head = serve(*common, name="head")
    node = serve(*common, "--node-rank", "1", "--headless", name="node1")
    head.wait_serving()
    node.wait_serving()
    ps = {p["name"]: p for p in head.ps()["processes"]}
    assert ps["worker dp0 pp0 tp1"]["state"] == "remote: ready" and ps["worker dp0 pp0 tp1"]["node"] == 1
    assert [p["name"] for p in node.ps()["processes"]] == ["worker dp0 pp0 tp1"]

    prompts = [f"the {i} way" for i in range(8)]
    n = 64  # (at 24 the decode loop in C++ finished every stream before the kill, now and then)
    reference = complete_all(head.client, prompts, n=n)
    assert all(reference)

    def kill_remote_worker(streams):
        mid_stream(streams, "the kill of the remote worker")
        os.kill(node.pids()["worker dp0 pp0 tp1"], 9)

    assert complete_all(head.client, prompts, n=n, during=kill_remote_worker) == reference
    restarts = {p["name"]: p["restarts"] for p in node.wait_serving()["processes"]}
    assert restarts == {"worker dp0 pp0 tp1": 1}  # node 1 restarted its worker
    head_restarts = {p["name"]: p["restarts"] for p in head.wait_serving()["processes"] if p.get("pid")}
    assert head_restarts["worker dp0 pp0 tp0"] == 1 and head_restarts["engine-core dp0"] == 0
    assert complete(head.client, prompts[0], n=n) == reference[0]  # the group is whole again

    pids = [pid for pid in (*head.pids().values(), *node.pids().values()) if pid]
    assert node.stop()[0] == 0 and head.stop()[0] == 0
    assert not [p for p in pids if psutil.pid_exists(p)]
