"""Two API servers on one port (SO_REUSEPORT), and an engine core killed with -9 mid-stream and
replaced: the stream goes on and ends with the text of an uninterrupted greedy run."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import httpx
import openai
import pytest

from tests.local_deployment import LocalDeployment, with_test_tokenizer

GREEDY = dict(model="tiny", prompt="Once upon a time", max_tokens=400, temperature=0.0,
              extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_model):
    run_dir = Path(tempfile.mkdtemp(prefix="vsup-"))
    model = with_test_tokenizer(tiny_model("llama_tied"), run_dir / "model")
    d = LocalDeployment(model, run_dir, num_api_servers=2, served_model_name="tiny", max_model_len=512,
                        kv_cache_bytes=4 << 20)
    d.start()
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def served_by(url: str, num_requests: int = 60) -> set[int]:
    """Which API servers answer /health on fresh connections (the kernel spreads them by source port)."""
    ranks = set()
    for _ in range(num_requests):
        with httpx.Client() as fresh:
            ranks.add(fresh.get(f"{url}/health").json()["api_server_rank"])
    return ranks


def test_two_api_servers_share_one_port_and_both_serve(server):
    assert served_by(server.url) == {0, 1}
    for _ in range(16):
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
            assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    for a in ("a0", "a1"):
        assert "POST /v1/completions" in server.log(a), f"{a} served no completion"


def test_engine_core_killed_mid_stream_is_replaced_and_the_stream_goes_on(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    reference = client.completions.create(**GREEDY).choices[0].text
    old_pid = server.procs["core-dp0"].pid
    stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **GREEDY)
    chunks = [next(stream)]
    server.kill("core-dp0")  # kill -9 while it generates; its worker exits on its own
    server.start_core(0)     # the supervisor's part: a new core and worker group
    try:
        chunks += list(stream)
        check_restart(server, chunks, reference, old_pid)
    finally:
        server.stop()  # this test started the replacements: they end with it (the fixture's stop is then a no-op)


def check_restart(server, chunks, reference, old_pid):
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference
    assert chunks[-1].usage.completion_tokens == 400
    logs = server.log("a0") + server.log("a1")
    assert "resubmitting its requests" in logs, "the core finished before it was killed: nothing was tested"
    for _ in range(2):
        health = httpx.get(f"{server.url}/health").json()
        assert health["dp_ranks"]["0"]["num_restarts"] == 1 and health["dp_ranks"]["0"]["pid"] != old_pid
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'vsup_restarts_total{role="engine-core"} 1.0' in metrics
