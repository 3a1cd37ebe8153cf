"""The default model (SmolLM2-135M-Instruct) behind the API server, through the official client:
multiprocess (API server, engine core, worker) and in-process mode."""

from __future__ import annotations

import re
import shutil
import tempfile

import httpx
import openai
import psutil
import pytest

from tests.local_deployment import LocalDeployment
from tests.polling import wait_for

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
JAPANESE = [{"role": "user", "content": "Translate 'thank you' into Japanese."}]


@pytest.fixture(scope="module")
def model_dir():
    from engine.model.default_model import default_model_dir
    return default_model_dir()


def deployment(model_dir, in_process: bool):
    d = LocalDeployment(model_dir, tempfile.mkdtemp(prefix="vsup-"), served_model_name="smollm2",
                        max_model_len=1024, kv_cache_bytes=64 << 20)
    d.start(in_process=in_process)
    try:
        d.wait_ready()
        yield d, openai.OpenAI(base_url=f"{d.url}/v1", api_key="x", max_retries=0, timeout=600)
    finally:
        d.stop()
        shutil.rmtree(d.run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def multiprocess(model_dir):
    yield from deployment(model_dir, in_process=False)


def chat_stream(client, messages, **kwargs) -> str:
    chunks = client.chat.completions.create(model="smollm2", messages=messages, stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_capital_of_france_streamed_and_not(multiprocess):
    server, client = multiprocess
    answer = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=30)
    assert answer.choices[0].message.content == "The capital of France is Paris."
    assert answer.choices[0].finish_reason == "stop"  # on EOS, which is counted but not shown
    assert answer.usage.completion_tokens == len(httpx.post(f"{server.url}/tokenize", json={
        "prompt": "The capital of France is Paris."}).json()["tokens"]) + 1
    assert chat_stream(client, FRANCE, temperature=0, max_tokens=30) == "The capital of France is Paris."


def test_eos_has_no_stop_reason_and_echoed_prompt_logprobs_match_transformers(multiprocess, model_dir, hf_logits):
    server, client = multiprocess
    answer = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=30,
                                            extra_body={"return_token_ids": True})
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].stop_reason is None  # EOS: vLLM's null
    assert len(answer.choices[0].token_ids) == answer.usage.completion_tokens
    assert answer.prompt_token_ids == httpx.post(f"{server.url}/tokenize", json={"messages": FRANCE}).json()["tokens"]
    prompt = "The capital of France is"
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    reference = hf_logits(model_dir, ids).log_softmax(-1)
    plain = client.completions.create(model="smollm2", prompt=prompt, max_tokens=3, temperature=0, logprobs=1)
    echoed = client.completions.create(model="smollm2", prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                                       echo=True).choices[0]
    assert echoed.text == prompt + plain.choices[0].text
    assert "".join(echoed.logprobs.tokens) == echoed.text and echoed.logprobs.token_logprobs[0] is None
    for p in range(1, len(ids)):
        assert echoed.logprobs.token_logprobs[p] == pytest.approx(float(reference[p - 1, ids[p]]), abs=1e-3)
    assert echoed.logprobs.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs,
                                                                      abs=1e-5)


def test_parse_on_smollm2_gives_a_validated_object_for_20_prompts(multiprocess):
    """Issue 21: chat.completions.parse with a pydantic model, on the real model, 20 prompts at once."""
    from concurrent.futures import ThreadPoolExecutor

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)

    _, client = multiprocess
    places = ["France", "Japan", "Italy", "Spain", "Kenya", "Peru", "Norway", "Egypt", "Chile", "Canada"]
    prompts = [f"Give the capital of {p} as JSON." for p in places] + [f"Name a big city in {p}." for p in places]

    def parse(prompt):
        return client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                             response_format=City, max_tokens=60, temperature=0)
    with ThreadPoolExecutor(len(prompts)) as pool:
        cities = [c.choices[0].message.parsed for c in pool.map(parse, prompts)]
    assert all(isinstance(c, City) and c.name for c in cities), cities
    assert cities[0].name == "Paris", cities[0]


def test_multibyte_output_streams_exactly_as_it_completes(multiprocess):
    _, client = multiprocess
    whole = client.chat.completions.create(model="smollm2", messages=JAPANESE, temperature=0, max_tokens=24)
    text = whole.choices[0].message.content
    assert sum(ord(ch) >= 0x3000 for ch in text) >= 5, text  # kana: three UTF-8 bytes, often split in tokens
    assert "\ufffd" not in text[:-1]  # the last token may cut a character in two: max_tokens ends it there
    assert chat_stream(client, JAPANESE, temperature=0, max_tokens=24) == text


def wait_idle(url: str) -> str:
    """The metrics once the core runs nothing (an abort, not an 800-token finish: that takes minutes)."""
    def idle():
        metrics = httpx.get(f"{url}/metrics").text
        return metrics if 'vsup_num_requests_running{dp_rank="0"} 0.0' in metrics else None
    return wait_for(idle, timeout=60, what="the core idle", now=lambda: httpx.get(f"{url}/metrics").text)


def aborted(metrics: str) -> float:
    """How many requests the core counts as aborted (0 before the first)."""
    found = re.search(r'^vsup_requests_finished_total\{finish_reason="abort"\} (\S+)$', metrics, re.M)
    return float(found[1]) if found else 0.0


def test_client_disconnect_aborts_the_request_in_the_core(multiprocess):
    server, client = multiprocess
    before = aborted(wait_idle(server.url))  # an earlier test's client may have given up on a request too
    long = dict(model="smollm2", prompt="Tell me a long story.", max_tokens=800, temperature=0, ignore_eos=True)
    stream = client.completions.create(stream=True, **{k: v for k, v in long.items() if k != "ignore_eos"},
                                       extra_body={"ignore_eos": True})
    next(stream), next(stream)
    stream.close()
    metrics = wait_idle(server.url)
    assert 'vsup_kv_cache_usage_perc{dp_rank="0"} 0.0' in metrics
    assert aborted(metrics) == before + 1
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=long, timeout=1.5)
    assert aborted(wait_idle(server.url)) == before + 2


def test_the_api_server_process_never_loads_torch(multiprocess):
    server, _ = multiprocess
    maps = {m.path for m in psutil.Process(server.procs["a0"].pid).memory_maps()}
    assert not any("libtorch" in path for path in maps)


def test_in_process_mode_serves_alike_in_one_process(model_dir):
    for server, client in deployment(model_dir, in_process=True):
        assert list(server.procs) == ["a0"]
        assert psutil.Process(server.procs["a0"].pid).children() == []
        answer = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=30)
        assert "Paris" in answer.choices[0].message.content
        sampled = dict(model="smollm2", prompt="A poem:", max_tokens=8, temperature=1.0, seed=7)
        assert client.completions.create(**sampled).choices[0].text == client.completions.create(**sampled).choices[0].text
        assert chat_stream(client, FRANCE, temperature=0, max_tokens=30) == answer.choices[0].message.content
        assert httpx.get(f"{server.url}/health").json()["up"] == [0]
