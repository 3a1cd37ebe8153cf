"""A stock vLLM under vsup (.vllm-venv, `make vllm`) through the faults that vLLM alone does not heal: a
poison request that kills its engine core every time, an engine that exits 0 (its issue #48966), and
an engine stuck with /health still 200 (#39863). One deployment of the default model, its tests in
order, each fault one restart of it or two (see test_vllm.py for the kills of each process).
"""

from __future__ import annotations

import json
import os
import signal

import openai
import pytest

from tests.e2e.vllm_served import POISON, fault_free, in_flight, running, tree_pids
from tests.polling import wait_for

# each test starts or restarts a vLLM tree once or more (about 45 s each on two idle cores, half as much
# again on a loaded one): the default 300 s per test is too tight
pytestmark = pytest.mark.timeout(600)


def poison(client, i, n, seen):
    """A completion whose prompt holds the token IDs the test hook kills the engine core on."""
    for chunk in client.completions.create(model="tiny", prompt=[504, 2759, *POISON], max_tokens=n, stream=True,
                                           temperature=0):
        seen.append(1)
    return "served"


def test_a_poison_request_fails_after_max_resumes_and_the_others_go_on(vllm_deployment):
    """The engine core dies each time it is given the poison prompt. The front resumes it --max-resumes
    times (1 here), alone among the suspects on its last try, then fails it with a clear error; the
    streams that shared the tree with it complete with their fault-free text."""
    counted = vllm_deployment.wait_serving(timeout=300)["units"]["vllm"]["by_role"].get("engine-core", 0)
    reference = fault_free(vllm_deployment.client, 4, 48)
    threads, outcomes, seen = in_flight(vllm_deployment.client, 4, 48)
    wait_for(lambda: all(seen) and all(o is None for o in outcomes), timeout=120, what="4 streams under way")
    bad_threads, bad, _ = in_flight(vllm_deployment.client, 1, 16, work=poison)
    for t in [*threads, *bad_threads]:
        t.join(timeout=400)
    assert isinstance(bad[0], openai.APIError) and "--max-resumes 1" in str(bad[0]), bad
    assert outcomes == reference
    state = vllm_deployment.wait_serving(timeout=300)
    assert state["units"]["vllm"]["by_role"]["engine-core"] == counted + 2  # its first try and its one resume


def test_an_engine_that_exits_0_is_restarted_under_on_failure(vllm_deployment):
    """vLLM's EngineCore stops its workers (exit 0) and ends cleanly on SIGTERM, and `vllm serve` follows
    it (its issue #48966): an exit vsup did not ask for restarts the tree, counted under the engine core."""
    serving = vllm_deployment.wait_serving(timeout=300)
    before, counted = tree_pids(serving), serving["units"]["vllm"]["by_role"].get("engine-core", 0)
    os.kill(before["engine-core dp0"], signal.SIGTERM)
    state = wait_for(lambda: (s := vllm_deployment.ps())
                     and s["units"]["vllm"]["by_role"].get("engine-core", 0) > counted and s,
                     timeout=60, what="the engine core's exit counted")
    assert "exit 0" in {p["last_exit"] for p in state["processes"]}
    vllm_deployment.wait_serving(timeout=300)


def test_requests_waiting_with_no_token_restart_the_tree(vllm_deployment):
    """vLLM answers /health with 200 while its engine is stuck (#39863): progress is watched too."""
    before = tree_pids(vllm_deployment.wait_serving(timeout=300))
    threads, outcomes, seen = in_flight(vllm_deployment.client, 4, 64)
    wait_for(lambda: all(seen) and all(o is None for o in outcomes), timeout=120, what="4 streams under way")
    os.kill(before["worker dp0 pp0 tp0"], signal.SIGSTOP)  # alive, stuck
    try:
        state = wait_for(lambda: (s := vllm_deployment.ps()) and s["supervisor"]["state"] != "serving" and s,
                         timeout=60, what="the hang noticed")
    finally:
        if running(before["worker dp0 pp0 tp0"]):
            os.kill(before["worker dp0 pp0 tp0"], signal.SIGCONT)
    for t in threads:
        t.join(timeout=300)
    assert all(isinstance(o, str) for o in outcomes), outcomes  # resumed on the new tree
    lines = vllm_deployment.vsup("logs", "--role", "supervisor", "--json").stdout
    assert any("no token for" in json.loads(line).get("why", "") for line in lines.splitlines())
    assert state["units"]["vllm"]["restarts"] >= 1
    vllm_deployment.wait_serving(timeout=300)
