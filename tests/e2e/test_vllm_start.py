"""A stock vLLM under vsup (.vllm-venv, `make vllm`) in other shapes and at start-up: a TP=2 tree that
kill -9 of vsup leaves nothing of, a vLLM that dies at every start, and flags refused before anything
starts. A tiny random model that vLLM's CPU attention takes (SmolLM2 has 9 heads: no TP=2).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import build_checkpoint, held_shm
from tests.e2e.served import VSUP, assert_gave_up, kill_until_it_gives_up
from tests.e2e.vllm_served import NATIVE, START_S, plan_names, running, serve_vllm, tree_pids
from tests.local_deployment import with_test_tokenizer
from tests.polling import wait_for

pytestmark = pytest.mark.timeout(2 * START_S)  # a vLLM tree takes 30-50 s to start on two cores, more if loaded


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """A tiny random Llama that vLLM's CPU attention takes (head_dim 64; 16 is refused), with a tokenizer."""
    raw = build_checkpoint(tmp_path_factory.mktemp("vllm-raw"), "llama", hidden_size=128, num_attention_heads=2,
                           num_key_value_heads=2, num_hidden_layers=2, intermediate_size=256,
                           tie_word_embeddings=True)
    return str(with_test_tokenizer(raw, tmp_path_factory.mktemp("vllm-tiny")))


def test_tp2_tree_is_the_plan_and_kill_9_of_vsup_leaves_nothing(vllm_bin, vllm_model, tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    s = serve_vllm(tmp_path, vllm_model, "-tp", "2", name="vllm-tp2",
                   env={"VSUP_HOOK_TEST_FD2": f"VLLM::Worker_TP1|{NATIVE}"})
    try:
        state = s.wait_serving(timeout=START_S)
        assert [p["name"] for p in state["processes"]] == plan_names("-tp", "2")
        lines = wait_for(lambda: (o := s.vsup("logs", "--role", "worker", "--tp", "1", "--json").stdout)
                         and NATIVE in o and o, timeout=60, what="worker tp1's native line")
        assert {json.loads(line)["name"] for line in lines.splitlines()} == {"worker dp0 pp0 tp1"}
        pids = tree_pids(state)
        assert set(os.listdir("/dev/shm")) - shm_before  # vLLM's CPU communicators made segments
        tmp = Path((tmp_path / "vllm-tp2" / "tmpdir").read_text())  # the tree's TMPDIR
        assert [p.name for p in tmp.iterdir() if p.name.startswith("vllm_dist_")]  # its rendezvous file
        s.proc.kill()  # kill -9 of vsup itself
        wait_for(lambda: not [pid for pid in pids.values() if running(pid)], timeout=2.0,
                 what=f"the tree gone within 2 s of vsup: {pids}")
        wait_for(lambda: not set(os.listdir("/dev/shm")) - shm_before - held_shm() and not tmp.exists(),
                 timeout=5.0, what="/dev/shm as it was (but what others hold), and the tree's TMPDIR gone")
    finally:
        s.kill()


def test_a_vllm_that_dies_at_start_up_gives_up_quoting_its_error(vllm_bin, vllm_model, tmp_path):
    """vLLM refuses a --max-model-len past the model's 512 positions, at every start: the start limit ends
    it, and the message quotes vLLM's own error. Before it starts anything, the supervisor removes what an
    earlier run of the deployment listed and left (as when systemd killed that run's janitor with it)."""
    run_dir = tmp_path / "vllm-bad"
    run_dir.mkdir(mode=0o700)
    left = Path("/dev/shm") / f"psm_vsup_test_{os.getpid()}"
    left.write_bytes(b"x")
    (left_tmp := tmp_path / "vsup-vllm-earlier").mkdir()
    (run_dir / "shm.txt").write_text(f"shared_memory /{left.name}\n")
    (run_dir / "tmpdir").write_text(str(left_tmp))
    s = serve_vllm(tmp_path, vllm_model, "--max-model-len", "4096", "--max-restarts", "0", name="vllm-bad")
    out, err = s.proc.communicate(timeout=280)
    assert s.proc.returncode == 1
    assert "0 restarts within 300 s" in err and "max_model_len" in err, err
    assert not left.exists() and not left_tmp.exists()
    logged = [json.loads(line) for line in s.vsup("logs", "--role", "supervisor", "--json").stdout.splitlines()]
    assert any(r["event"] == "removed what an earlier run left in /dev/shm" and r["entries"] == [left.name]
               for r in logged), logged


def test_a_front_killed_each_time_it_is_back_gives_up_and_leaves_nothing(vllm_bin, vllm_model, tmp_path):
    """vsup's front holds the port: past --max-restarts nothing holds it any more, so `vsup serve` exits 1
    saying that the front gave up and why (it crashed with a TypeError once), and the tree goes with it."""
    s = serve_vllm(tmp_path, vllm_model, "--max-restarts", "2", name="vllm-front")
    tree = tree_pids(s.wait_serving(timeout=START_S))
    code, _, err, killed = kill_until_it_gives_up(s, "front", timeout=START_S)
    assert code == 1 and len(killed) == 3, (code, killed, err)
    assert_gave_up(err, "front gave up: 2 restarts within 300 s (last exit: signal 9 (SIGKILL))")
    wait_for(lambda: not [pid for pid in [*tree.values(), *killed] if running(pid)], timeout=30,
             what="the tree and every front gone")


def test_bad_vllm_flags_exit_2_before_anything_starts(vllm_bin, vllm_model, tmp_path):
    env = {**os.environ, "VSUP_HOME": str(tmp_path)}

    def serve(*flags):
        return subprocess.run([*VSUP, "serve", vllm_model, "--engine", "vllm", "--device", "cpu", *flags],
                              capture_output=True, text=True, env=env, timeout=300)

    missing = serve("--vllm-bin", str(tmp_path / "no-vllm"))
    assert missing.returncode == 2 and "--vllm-bin" in missing.stderr and "make vllm" in missing.stderr
    unknown = serve("--", "--no-such-vllm-flag", "3")
    assert unknown.returncode == 2 and "--no-such-vllm-flag" in unknown.stderr
    headless = serve("--dp-lockstep")
    assert headless.returncode == 2 and "--dp-lockstep" in headless.stderr and "--engine vllm" in headless.stderr
    not_gib = serve("--kv-cache-memory", "512MiB")
    assert not_gib.returncode == 2 and "whole GiB" in not_gib.stderr
    assert not (tmp_path / "default").exists()  # nothing started, no run dir
