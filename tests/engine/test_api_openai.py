"""The OpenAI routes through the official client, against a real API server, engine core and
worker on the tiny model. Its test tokenizer encodes prompts character by character and decodes
outputs into words, and into whole or broken multi-byte characters split across tokens."""

from __future__ import annotations


import httpx
import openai
import pytest

from tests.local_deployment import serve_tiny

KEY = "test-key"
GREEDY = dict(model="tiny", temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_model):
    yield from serve_tiny(tiny_model, served_model_name="tiny", max_model_len=256, kv_cache_bytes=2 << 20,
                          api_args=("--api-key", KEY))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].text if hasattr(c.choices[0], "text") else (c.choices[0].delta.content or "")
                   for c in chunks if c.choices)
    return text, chunks


def test_models_version_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["up"] == [0] and health["dp_ranks"]["0"]["state"] == "ready"
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_streamed_equals_whole_with_usage(client):
    whole = client.completions.create(prompt="Hello", max_tokens=40, **GREEDY)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (5, 40, 45)
    text, chunks = stream_text(client.completions.create(prompt="Hello", max_tokens=40, stream=True,
                                                         stream_options={"include_usage": True}, **GREEDY))
    assert text == whole.choices[0].text  # broken characters too, held back alike
    assert chunks[-1].usage.completion_tokens == 40 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_equals_whole_with_usage(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    whole = client.chat.completions.create(messages=messages, max_tokens=24, **GREEDY)
    prompt = "<s>system: Be brief.\n<s>user: Hi 😀\n<s>assistant: "
    assert whole.usage.prompt_tokens == len(prompt) - 3 * 2 + 3  # <s> is one token; 😀 is four
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 24
    text, chunks = stream_text(client.chat.completions.create(messages=messages, max_tokens=24, stream=True,
                                                              stream_options={"include_usage": True}, **GREEDY))
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def printable_window(text: str, start: int, size: int = 6) -> str:
    """A stop string from the text: 6 characters span two tokens at least (none is longer than 5)."""
    for i in range(start, len(text) - size):
        window = text[i:i + size]
        if window.isprintable() and "\ufffd" not in window and text.index(window) == i:
            return window
    pytest.skip("no printable window in this model's output")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_spanning_tokens_are_not_returned(client, stream):
    reference = client.completions.create(prompt="Once upon", max_tokens=64, **GREEDY).choices[0].text
    stop = printable_window(reference, 4)
    for include, expected in [(False, reference[:reference.index(stop)]),
                              (True, reference[:reference.index(stop) + len(stop)])]:
        kwargs = dict(prompt="Once upon", max_tokens=64, stop=[stop, "never there"], model="tiny", temperature=0.0,
                      extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        if stream:
            text, chunks = stream_text(client.completions.create(stream=True, **kwargs))
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.completions.create(**kwargs).choices[0]
            text, finish = choice.text, choice.finish_reason
        assert (text, finish) == (expected, "stop")


def test_stop_token_ids_end_the_output_and_are_counted_not_shown(client, server):
    ids_of = dict(logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    reference = client.completions.create(prompt="abc", max_tokens=30, model="tiny", temperature=0.0, **ids_of)
    ids = [int(t.removeprefix("token_id:")) for t in reference.choices[0].logprobs.tokens]
    assert len(ids) == 30
    stop_id = ids[9]
    out = client.completions.create(prompt="abc", max_tokens=30, model="tiny", temperature=0.0, logprobs=0,
                                    extra_body={"stop_token_ids": [stop_id], "ignore_eos": True,
                                                "return_tokens_as_token_ids": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == ids.index(stop_id) + 1
    assert out.choices[0].logprobs.tokens[-1] == f"token_id:{stop_id}"
    shown = httpx.post(f"{server.url}/detokenize", json={"tokens": ids[:ids.index(stop_id)]})
    assert out.choices[0].text == shown.json()["prompt"]


def test_seeds_n_and_batched_prompts(client):
    sampled = dict(model="tiny", prompt="xyz", max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, n=3, **sampled)
    b = client.completions.create(seed=1234, n=3, **sampled)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # each choice draws its own stream
    assert a.usage.completion_tokens == 48 and a.usage.prompt_tokens == 3
    greedy = client.completions.create(prompt=["xyz", "ab"], n=2, max_tokens=8, **GREEDY)
    texts = [c.text for c in greedy.choices]
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3] and texts[0] == texts[1] and texts[2] == texts[3]
    as_ids = client.completions.create(prompt=[ord(c) - 29 for c in "xyz"], max_tokens=8, **GREEDY)  # ASCII is 3..97
    assert as_ids.choices[0].text == texts[0] and greedy.usage.prompt_tokens == 5


def test_logprobs_in_both_shapes(client):
    out = client.completions.create(prompt="log", max_tokens=6, logprobs=3, model="tiny", temperature=0.0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and lp.text_offset[0] == 0
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert sampled <= 0 and 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(sampled, abs=1e-5)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "x"}], max_tokens=5, logprobs=True,
                                          top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_tokenize_detokenize(server):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "héllo"}).json()
    assert tokens["tokens"] == [75, 99, 100, 79, 79, 82] and tokens["max_model_len"] == 256  # é is two tokens
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "a"}]}).json()
    assert chat["tokens"][0] == 1 and chat["count"] == 1 + len("user: a\n") + 1 + len("assistant: ")
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}


def test_metrics_count_what_was_served(server, client):
    client.completions.create(prompt="m", max_tokens=4, **GREEDY)
    text = httpx.get(f"{server.url}/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["vsup_time_to_first_token_seconds_count"] >= 1
    assert values["vsup_inter_token_latency_seconds_count"] >= 3
    assert values["vsup_e2e_request_latency_seconds_count"] >= 1
    assert values["vsup_generation_tokens_total"] >= 4 and values["vsup_prompt_tokens_total"] >= 1
    assert values['vsup_num_requests_running{dp_rank="0"}'] == 0
    assert values['vsup_kv_cache_usage_perc{dp_rank="0"}'] == 0
    assert values['vsup_engine_up{dp_rank="0"}'] == 1 and values['vsup_restarts_total{role="worker"}'] == 0


# /v1/responses

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_responses_give_the_chat_completions_text_whole_and_streamed(client):
    chat = client.chat.completions.create(messages=CONVERSATION, max_tokens=12, **GREEDY)
    whole = client.responses.create(model="tiny", instructions="Be brief.", temperature=0.0, max_output_tokens=12,
                                    input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                                    extra_body={"ignore_eos": True})
    assert whole.id.startswith("resp_") and whole.output_text == chat.choices[0].message.content
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert [(o.type, o.role) for o in whole.output] == [("message", "assistant")]

    with client.responses.stream(model="tiny", instructions="Be brief.", input="Hi", temperature=0.0,
                                 max_output_tokens=12, extra_body={"ignore_eos": True}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == 12
    assert final.status == "incomplete"


def test_a_tool_conversation_goes_through_the_chat_template_and_unserved_fields_are_400(client):
    done = client.responses.create(model="tiny", max_output_tokens=4, temperature=0.0, input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}], extra_body={"ignore_eos": True})
    assert done.usage.output_tokens == 4
    for extra, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                          "input"),
                         ({"input": [{"role": "robot", "content": "x"}]}, "input")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": "tiny", "input": "x", **extra})
        assert e.value.body["param"] == param, e.value.body
