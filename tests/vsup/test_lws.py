"""A pod's place in its LeaderWorkerSet group (vsup/k8s/lws.py): the same flags on every pod, the group's
variables fill in rank, headless and addresses; a flag that contradicts the group is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vsup.errors import UsageError
from vsup.k8s.lws import DP_PORT, from_lws


def lws(index: int, size: int = 2) -> dict:
    return {"LWS_WORKER_INDEX": str(index), "LWS_GROUP_SIZE": str(size),
            "LWS_LEADER_ADDRESS": "llm-0.llm.default"}


def test_outside_a_group_the_flags_stand():
    values = {"nnodes": 2, "node_rank": 1, "headless": True}
    assert from_lws(values, {}) is values


def test_a_tp_group_across_pods_takes_rank_headless_and_master_from_the_group():
    flags = {"nnodes": 2, "node_rank": 0, "headless": False, "master_addr": "127.0.0.1"}
    assert from_lws(flags, lws(0)) == {**flags, "master_addr": "llm-0.llm.default"}
    assert from_lws(flags, lws(1)) == {"nnodes": 2, "node_rank": 1, "headless": True,
                                       "master_addr": "llm-0.llm.default"}
    assert from_lws({**flags, "headless": True}, lws(1))["node_rank"] == 1  # a worker may say --headless itself
    assert from_lws({**flags, "master_addr": "10.0.0.1"}, lws(1))["master_addr"] == "10.0.0.1"  # given: kept


def test_dp_ranks_across_pods_take_their_first_rank_and_the_leaders_address():
    flags = {"data_parallel_size": 4, "data_parallel_size_local": 2, "headless": False}
    assert from_lws(flags, lws(0)) == {**flags, "data_parallel_start_rank": None,
                                       "dp_address": f"llm-0.llm.default:{DP_PORT}"}
    assert from_lws(flags, lws(1)) == {**flags, "data_parallel_start_rank": 2, "headless": True,
                                       "dp_address": f"llm-0.llm.default:{DP_PORT}"}


@pytest.mark.parametrize("flags,env,says", [
    ({"nnodes": 3}, lws(1), "--nnodes 3, but this LeaderWorkerSet's group has LWS_GROUP_SIZE=2 pods"),
    ({"nnodes": 2, "node_rank": 1}, lws(0), "--node-rank 1, but this pod is LWS_WORKER_INDEX=0"),
    ({"data_parallel_size": 6, "data_parallel_size_local": 2}, lws(1), "makes 3 nodes"),
    ({"data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_start_rank": 1}, lws(1),
     "runs ranks from 2"),
    ({"data_parallel_size": 2}, lws(1), "the flags plan one node"),
    ({"nnodes": 2, "headless": True}, lws(0), "--headless on the group's leader"),
    ({"nnodes": 2}, {**lws(1), "LWS_WORKER_INDEX": "one"}, "must be whole numbers"),
    ({"nnodes": 2}, {**lws(1), "LWS_WORKER_INDEX": "2"}, "the index must be below the size"),
])
def test_a_flag_against_the_group_is_refused_naming_both(flags, env, says):
    with pytest.raises(UsageError, match=says.replace("(", r"\(").replace(")", r"\)")):
        from_lws(flags, env)


def test_serve_in_a_pod_refuses_a_contradiction_with_exit_2_before_anything_starts(tmp_path):
    """Through the CLI: the group's variables reach `vsup serve` (and `plan`, which shows this pod's share)."""
    env = {"PATH": "/usr/bin:/bin", "VSUP_HOME": str(tmp_path), **lws(1, size=3)}
    serve = subprocess.run([sys.executable, "-m", "vsup", "serve", "--device", "cpu", "--nnodes", "2", "-tp", "2"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert serve.returncode == 2 and "LWS_GROUP_SIZE=3" in serve.stderr and serve.stderr.count("\n") == 1
    plan = subprocess.run([sys.executable, "-m", "vsup", "plan", "--device", "cpu", "--nnodes", "3", "-tp", "3"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert plan.returncode == 0, plan.stderr
    assert "worker dp0 pp0 tp1" in plan.stdout and "api-server" not in plan.stdout  # pod 1: its worker only
