"""A worker killed with -9 and started again later than the API servers' heartbeat timeout: its engine
core, waiting for the new worker group, still says it lives, so its requests stay there (rather than
moving to a rank that may be worse off) and end with the tokens of an uninterrupted run."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import httpx
import openai

from tests.e2e.served import Streams, complete_all, mid_stream
from tests.local_deployment import LocalDeployment, with_test_tokenizer
from tests.polling import wait_for

HEARTBEAT_TIMEOUT_S = 4.0  # (heartbeats every 1 s: a 2 s timeout ran out once in `make test` on a loaded machine)
PROMPTS = [f"the {i} way" for i in range(12)]  # (about 6 a rank: with 3, dp0's once ended before the kill)
LONG = 480  # of the tiny model's 512 positions


def test_a_core_waiting_for_its_workers_keeps_its_requests(tiny_model):
    run_dir = Path(tempfile.mkdtemp(prefix="vsup-"))
    model = with_test_tokenizer(tiny_model("llama_tied"), run_dir / "model")
    d = LocalDeployment(model, run_dir, data_parallel_size=2, served_model_name="tiny", max_model_len=512,
                        api_args=("--engine-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)))
    try:
        d.start()
        d.wait_ready()
        client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="x", max_retries=0, timeout=120)
        reference = complete_all(client, PROMPTS, n=LONG)

        def health():
            return httpx.get(f"{d.url}/health", timeout=5).json()

        streams = Streams(client, PROMPTS, n=LONG)
        # the kill as soon as the streams run (a stream of the tiny model takes a second or two, less on a
        # fast machine, where the API server, busy streaming, answered /health only once they had ended);
        # the two ranks share them, and dp0's held ones are checked below
        mid_stream(streams, "the kill of worker-dp0")
        d.kill("worker-dp0")
        # a core notices a dead worker of its own node at its next step, or within a second when idle
        wait_for(lambda: "worker group lost" in d.log("core-dp0"), 30, "the core never noticed its worker died",
                 now=d.log_tails)
        held = health()["dp_ranks"]["0"]["num_in_flight"]  # frozen from here: dp0 has no worker
        assert held and streams.running(), f"dp0's streams ({held} left) ended before the fault"

        deadline = time.monotonic() + 3 * HEARTBEAT_TIMEOUT_S  # no worker meanwhile: the core waits for one
        while time.monotonic() < deadline:
            body = health()
            assert 0 in body["up"] and body["dp_ranks"]["0"]["num_in_flight"] == held, body
            time.sleep(0.2)
        assert "moving its requests" not in d.log("a0")

        d.start_worker(0)
        assert streams.texts() == reference
        assert "moving its requests" not in d.log("a0")
    finally:
        codes = d.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    assert all(code == 0 for name, code in codes.items() if not name.startswith("replaced")), list(codes.items())


def test_an_idle_core_notices_its_dead_worker_and_serves_with_the_next(tiny_model):
    """No request to step: the core still finds its worker's death by its pid, and forms the group again
    with the worker started next (a bare engine, with no supervisor to tell it)."""
    run_dir = Path(tempfile.mkdtemp(prefix="vsup-"))
    model = with_test_tokenizer(tiny_model("llama_tied"), run_dir / "model")
    d = LocalDeployment(model, run_dir, served_model_name="tiny", max_model_len=512)
    try:
        d.start()
        d.wait_ready()
        client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="x", max_retries=0, timeout=120)
        reference = complete_all(client, PROMPTS[:2], n=16)  # (ended: the core has nothing to step)
        d.kill("worker-dp0")
        wait_for(lambda: "worker group lost" in d.log("core-dp0"), 30, "the idle core never noticed its worker died",
                 now=d.log_tails)
        d.start_worker(0)
        wait_for(lambda: "worker group back" in d.log("core-dp0"), 60, "the group formed again", now=d.log_tails)
        assert complete_all(client, PROMPTS[:2], n=16) == reference
    finally:
        codes = d.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    assert all(code == 0 for name, code in codes.items() if not name.startswith("replaced")), list(codes.items())
