"""`vsup plan --k8s`'s LeaderWorkerSet, run as a group of pods without a cluster (tests/e2e/pods.py): our
engine with DP across 2 pods, each a network namespace, each pod's container command as the YAML has it.

One test, in the order a group lives: it serves a completion through the leader; a worker process killed
inside a pod is healed inside it while liveness never fails and no request fails; a pod whose vsup is
killed makes the leader unready (its /readyz names the rank) within --health-timeout, and the group is
recreated as LWS would; SIGTERM to every pod drains each within the grace period, exit 0."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime

import httpx
import openai
import pytest

from tests.e2e.netns import lan_for_a_test
from tests.e2e.pods import Group, manifests
from tests.e2e.served import Streams
from tests.polling import wait_for
from vsup.addresses import is_ring_of

PROMPTS = [f"the {i} way" for i in range(6)]
SECRET = {"cluster-secret": "pods-test-secret"}
# deployment names carry the pid: /dev/shm is one for every pod, and a stop sweeps the rings of its name
PODS, LONE = f"pods{os.getpid()}", f"lone{os.getpid()}"


def rings_left(name: str) -> list[str]:
    return [entry for entry in os.listdir("/dev/shm") if is_ring_of(name, entry)]


@pytest.fixture
def lan():
    yield from lan_for_a_test(2, tag=f"k{os.getpid()}")


def ps(group: Group, pod: int) -> dict:
    return json.loads(group.vsup(pod, "ps", "--json").stdout)


@pytest.mark.timeout(600)
def test_a_dp_group_of_two_pods_heals_inside_is_recreated_as_lws_would_and_drains(lan, model, tmp_path):
    docs = manifests(model, "-dp", "2", "--dp-size-local", "1", "--api-server-count", "1", "--device", "cpu",
                     "--kv-cache-memory", "4MiB", "--max-model-len", "256", "--served-model-name", "tiny",
                     "--name", PODS)
    group = Group(docs, lan, tmp_path, SECRET)
    assert group.size == 2
    try:
        started = time.monotonic()
        group.start()
        wait_for(lambda: group.ready(0) and group.ready(1), 180, "both pods ready, as the kubelet sees them")
        first_start = time.monotonic() - started
        client = openai.OpenAI(base_url=f"{group.url(0, 'http')}/v1", api_key="none", max_retries=0, timeout=120)
        assert client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0).choices[0].text

        # a worker process dies inside pod 1: healed there; liveness never fails; no request fails
        streams = Streams(client, PROMPTS, n=200)
        wait_for(lambda: streams.all_streaming() and ps(group, 0)["processes"] and _dp1_busy(group), 60,
                 "the streams running, some on dp1 (pod 1)")
        worker = next(p for p in ps(group, 1)["processes"] if p["name"] == "worker dp1 pp0 tp0")
        killed_at = time.monotonic()
        os.kill(worker["pid"], 9)
        assert streams.running(), "every stream ended before the kill: make them longer"  # the fault hit work
        wait_for(lambda: any(t > killed_at and r != 200 for t, _, r, _ in group.pods[1].seen), 15,
                 "pod 1 unready while its worker group restarts")
        wait_for(lambda: group.ready(1) and all(
            p["restarts"] == 1 for p in ps(group, 1)["processes"] if p["name"] == "worker dp1 pp0 tp0"), 120,
            "pod 1 ready again, its worker restarted inside it")
        healed_s = time.monotonic() - killed_at
        texts = streams.texts()
        assert all(isinstance(t, str) and t for t in texts), texts  # 0 failed
        assert all(live == 200 for pod in group.pods for _, live, _, _ in pod.seen)  # liveness never failed

        # pod 1's vsup dies: its processes go with it, the leader's readiness fails naming the rank
        lost_at = time.monotonic()
        os.kill(group.pods[1].proc.pid, 9)
        group.pods[1].proc.wait()
        wait_for(lambda: not lan.pids(1), 10, "pod 1's processes gone with its vsup")
        wait_for(lambda: group.pods[0].seen[-1][0] > lost_at and group.pods[0].seen[-1][2] == 503, 30,
                 "the leader unready once dp1 is lost")
        unready_s = time.monotonic() - lost_at
        assert "dp1 down" in group.pods[0].seen[-1][3], group.pods[0].seen[-1]
        assert all(live == 200 for _, live, _, _ in group.pods[0].seen)  # the leader itself lives on

        # LWS recreates the group: every pod deleted (SIGTERM), then started again
        recreated_at = time.monotonic()
        assert group.terminate([0])[0][0] == 0
        for pod in group.pods:
            pod.seen.clear()
        group.start()
        wait_for(lambda: group.ready(0) and group.ready(1), 180, "the recreated group ready")
        assert client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0).choices[0].text
        recreate_s = time.monotonic() - recreated_at

        # every pod deleted: each drains within the grace period and exits 0
        stopped = group.terminate()
        assert [code for code, _ in stopped] == [0, 0], stopped
        assert all(seconds < group.grace_s for _, seconds in stopped), stopped
    finally:
        group.close()
    assert not rings_left(PODS)
    print(f"\nfirst start {first_start:.1f} s; worker kill -9 to pod ready {healed_s:.1f} s; leader unready "
          f"{unready_s:.1f} s after pod 1's vsup died; group recreated and serving in {recreate_s:.1f} s")


def _dp1_busy(group: Group) -> bool:
    body = httpx.get(f"{group.url(0, 'http')}/health", timeout=5).json()
    return body["dp_ranks"].get("1", {}).get("num_in_flight", 0) > 0


@pytest.mark.timeout(300)
def test_a_worker_pod_whose_leader_is_gone_gives_up_within_health_timeout(lan, model, tmp_path):
    """vLLM's headless nodes wait for a dead head forever (vLLM #32136), so LWS never rebuilds the group; a
    vsup pod exits 1 once its head has not answered for --health-timeout, saying so, and leaves nothing."""
    docs = manifests(model, "-dp", "2", "--dp-size-local", "1", "--api-server-count", "1", "--device", "cpu",
                     "--kv-cache-memory", "4MiB", "--max-model-len", "256", "--health-timeout", "6", "--name", LONE)
    group = Group(docs, lan, tmp_path, SECRET)
    try:
        group.start()
        wait_for(lambda: group.ready(0) and group.ready(1), 180, "both pods ready")
        lost_at = time.time()
        os.kill(group.pods[0].proc.pid, 9)
        code = group.pods[1].proc.wait(timeout=90)  # (the decision, then an orderly stop of the pod)
        said = group.pods[1].proc.stderr.read()
        records = [json.loads(line) for line in group.vsup(1, "logs", "--role", "supervisor", "--json").stdout
                   .splitlines()]
    finally:
        group.close()
    assert code == 1 and f"the head node at {lan.address(0)}:8081 has not answered" in said, said
    gave_up = next(r for r in records if r["event"].startswith("the head node at"))
    decided_s = datetime.fromisoformat(gave_up["ts"].replace("Z", "+00:00")).timestamp() - lost_at
    # --health-timeout from the head's last answer, which came up to a probe period (2 s) before the kill,
    # then up to a period more for the next probe to see it gone
    assert 6 - 2 < decided_s <= 6 + 2 + 1, decided_s
    wait_for(lambda: not lan.pids(1), 10, "nothing left in pod 1")
    assert not rings_left(LONE)  # the leader's, killed with it, swept by pod 1's orderly stop
