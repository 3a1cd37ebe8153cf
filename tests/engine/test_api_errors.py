"""Errors in OpenAI's format (401, 400, 404, 413, 503) through the official client, malformed
requests, and a schemathesis fuzz of the OpenAPI schema: no 5xx, and the server serves after."""

from __future__ import annotations

import collections
import json
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.local_deployment import LocalDeployment, running, with_test_tokenizer
from tests.polling import wait_for

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    base = Path(tempfile.mkdtemp(prefix="vsup-"))
    yield with_test_tokenizer(tiny_model("llama_tied"), base / "model")
    shutil.rmtree(base, ignore_errors=True)


def deployment(model_dir, env: dict | None = None) -> LocalDeployment:
    return LocalDeployment(model_dir, tempfile.mkdtemp(prefix="vsup-"), served_model_name="tiny", max_model_len=128,
                           kv_cache_bytes=8 << 20, api_args=("--api-key", KEY, "--max-request-body-bytes",
                                                              str(BODY_LIMIT)), env=env)


@pytest.fixture(scope="module")
def server(model_dir):
    yield from running(deployment(model_dir))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def assert_openai_error(body: dict, status: int) -> dict:
    """`body` is a response's JSON, or an openai exception's `.body` (the inner "error" object)."""
    error = body.get("error", body)
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    return error


def wait_listening(url: str) -> httpx.Response:
    for _ in range(200):
        try:
            return httpx.get(f"{url}/health", timeout=2)
        except httpx.TransportError:
            time.sleep(0.05)
    raise TimeoutError(url)


def test_503_and_starting_health_while_no_engine_core_is_up_and_ready_only_once_one_is(model_dir):
    """Alone, an API server listens at once and answers 503 "starting"; it logs `ready` (what the supervisor
    waits for before it says "serving") only once an engine core can take requests: the first request
    after it is served."""
    d = deployment(model_dir, env={"VSUP_LOG_FORMAT": "json"})
    d.start_api_servers()  # no engine core
    try:
        health = wait_listening(d.url)
        assert health.status_code == 503 and health.json()["status"] == "starting" and health.json()["down"] == [0]
        client = openai.OpenAI(base_url=f"{d.url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503
        assert assert_openai_error(e.value.body, 503)["code"] == "engine_unavailable"
        assert [m.id for m in client.models.list().data] == ["tiny"]

        def said_ready():
            return any(json.loads(line).get("event") == "ready" for line in d.log("a0").splitlines()
                       if line.startswith("{"))
        assert not said_ready(), d.log("a0")
        d.start_core(0)
        wait_for(said_ready, timeout=120, what="the API server's ready once its core is", interval=0.01)
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        d.stop()
        shutil.rmtree(d.run_dir, ignore_errors=True)


def test_401_without_the_api_key_on_v1_only(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert e.value.status_code == 401
    response = httpx.get(f"{server.url}/v1/models")  # no key at all
    assert response.status_code == 401 and assert_openai_error(response.json(), 401)["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200  # operations routes are open


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=127), "max_tokens"),  # prompt 2 + max_tokens 127 > max_model_len 128
    (dict(prompt="x" * 130), "prompt"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(extra_body={"top_k": -2}), "top_k"),
    (dict(max_tokens="5"), "max_tokens"),
    (dict(extra_body={"n": 0}), "n"),
    (dict(logprobs=21), "logprobs"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(extra_body={"stop_token_ids": [999]}), "stop_token_ids"),
    (dict(prompt=[5, 300]), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    (dict(extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),  # vLLM too, past its default max_logprobs 20
    (dict(stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
])
def test_400_for_invalid_completion_parameters(client, kwargs, param):
    args = dict(model="tiny", prompt="hi", max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    assert assert_openai_error(e.value.body, 400)["param"] == param, e.value.body


def test_400_for_invalid_chat_requests_and_404_for_unknown_models(client, server):
    for messages in ([], [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 5}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=messages)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert assert_openai_error(e.value.body, 404)["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    response = httpx.get(f"{server.url}/v1/nothing-here", headers=AUTH)
    assert response.status_code == 404 and assert_openai_error(response.json(), 404)


def test_413_for_a_body_over_the_limit_sized_or_chunked(client, server):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="x" * (BODY_LIMIT + 1), max_tokens=2)
    assert e.value.status_code == 413

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    response = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=AUTH)
    assert response.status_code == 413 and assert_openai_error(response.json(), 413)


MALFORMED = [b"", b"{", b"[]", b'"text"', b"null", b'{"prompt": null}', b'{"prompt": "\\ud800 lone surrogate"}',
             b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "max_tokens": 1e308}',
             b'{"prompt": "x", "seed": 1180591620717411303424}', b'{"prompt": "x", "n": 1000000000}',
             b'{"prompt": "x", "stop": [""], "max_tokens": 2, "best_of": 3}', b'{"prompt": [[1, 2], [-1]]}',
             b'{"prompt": "x", "stream": true, "max_tokens": 0}', b'{"prompt": "x", "stream_options": {}}',
             b'{"messages": [{"role": "user"}], "max_tokens": "many"}',
             b'{"prompt": "x", "stream": true, "prompt_logprobs": 1}',
             b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}']


@pytest.mark.parametrize("body", MALFORMED)
def test_malformed_requests_are_4xx_in_openai_format(server, body):
    route = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    response = httpx.post(f"{server.url}{route}", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert 400 <= response.status_code < 500, response.text
    assert_openai_error(response.json(), response.status_code)


def test_extreme_but_valid_values_are_served(client):
    out = client.completions.create(model="tiny", prompt="x", max_tokens=3, seed=2**64 - 1, presence_penalty=2,
                                    frequency_penalty=-2, logprobs=20, temperature=1e6,
                                    extra_body={"top_k": 2**70, "min_p": 1.0, "min_tokens": 3, "n": 4,
                                                "repetition_penalty": 1e9})
    assert len(out.choices) == 4 and out.usage.completion_tokens == 12


def test_fuzzing_the_openapi_schema_finds_no_5xx_and_leaves_the_server_serving(server, client):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    strategy = schema.as_strategy(schemathesis.GenerationMode.POSITIVE) | schema.as_strategy(
        schemathesis.GenerationMode.NEGATIVE)
    seen = []

    @settings(max_examples=150, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def no_server_error(case):
        response = case.call(base_url=server.url, headers=AUTH, timeout=60)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400 and response.headers.get("content-type") == "application/json":
            assert_openai_error(json.loads(response.text), response.status_code)

    no_server_error()
    print(sorted(collections.Counter(seen).items()))
    assert any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen)
    assert httpx.get(f"{server.url}/health").status_code == 200
    out = client.completions.create(model="tiny", prompt="still here?", max_tokens=3)
    assert out.usage.completion_tokens >= 1
    assert all(p.poll() is None for p in server.procs.values())
