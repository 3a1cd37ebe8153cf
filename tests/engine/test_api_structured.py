"""Structured outputs through the official client, against a real API server, engine core and worker
on the tiny model: its weights are random, so whatever validates does so because the grammar forced it."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel, Field

from tests.local_deployment import LocalDeployment, serve_tiny, with_test_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
REGEX = r"[a-z]{3,6}-[0-9]{2}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
MAX_GRAMMAR_BYTES = 128 << 10
GREEDY = dict(model="tiny", temperature=0.0)
COMPACT = {"disable_any_whitespace": True}  # a random model would write whitespace until max_tokens


class Person(BaseModel):
    name: str = Field(max_length=8)  # short: a random model never closes a free string
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(tiny_model):
    limits = ("--max-grammar-bytes", str(MAX_GRAMMAR_BYTES), "--grammar-compile-timeout", "1")
    yield from serve_tiny(tiny_model, served_model_name="tiny", max_model_len=512, kv_cache_bytes=4 << 20,
                          api_args=limits, core_args=limits)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def valid_person(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"name", "age", "ok"} and isinstance(value["name"], str) and len(value["name"]) <= 8
    assert isinstance(value["age"], int) and isinstance(value["ok"], bool)
    return value


def structured(kind: str) -> dict:
    return {"json": SCHEMA, "regex": REGEX, "choice": CHOICES, "grammar": GRAMMAR}[kind]


def check(kind: str, text: str) -> None:
    if kind == "json":
        valid_person(text)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\((?:[0-9x])(?:,[0-9x])*\)", text), text


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar"])
def test_each_structured_outputs_mode_validates(client, kind):
    out = client.completions.create(prompt="Say it:", max_tokens=200, extra_body={"structured_outputs": {
        kind: structured(kind), **COMPACT}}, **GREEDY)
    assert out.choices[0].finish_reason == "stop", out.choices[0]
    check(kind, out.choices[0].text)


def test_response_format_json_object_and_json_schema_on_chat(client):
    # any object: its keys are free strings, which a random model never closes: an object's opening only
    out = client.chat.completions.create(messages=[{"role": "user", "content": "JSON"}], max_tokens=30,
                                         response_format={"type": "json_object"},
                                         extra_body={"structured_outputs": COMPACT}, **GREEDY).choices[0]
    assert out.message.content.startswith('{"') and out.finish_reason == "length"
    messages = [{"role": "user", "content": "JSON please"}]
    out = client.chat.completions.create(messages=messages, max_tokens=200, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
        extra_body={"structured_outputs": COMPACT}, **GREEDY)
    valid_person(out.choices[0].message.content)


def test_response_format_json_schema_on_completions_streamed_n2_sampled(client):
    stream = client.completions.create(prompt="JSON:", max_tokens=200, n=2, stream=True, temperature=1.0, seed=7,
                                       model="tiny", extra_body={"response_format": {
                                           "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
                                           "structured_outputs": COMPACT})
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    for text in texts:
        valid_person(text)


PROMPTS = [f"{who}, {how}?" for who in ("who", "Name a poet", "A sailor", "Your aunt", "Someone")
           for how in ("briefly", "in JSON", "now", "please")]


def test_parse_with_a_pydantic_model_on_20_varied_prompts(client):
    def parse(i, prompt):
        return client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": prompt}],
                                             response_format=Person, max_tokens=200, temperature=0.0 if i % 2 else 1.0,
                                             seed=i, extra_body={"structured_outputs": COMPACT})
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        completions = list(pool.map(parse, range(len(PROMPTS)), PROMPTS))
    people = [c.choices[0].message.parsed for c in completions]
    assert all(isinstance(p, Person) and 0 <= p.age <= 120 for p in people), people


def test_sampled_seeded_structured_requests_validate_and_repeat(client):
    def run():
        body = {"structured_outputs": {"json": SCHEMA, **COMPACT}}
        return [client.completions.create(prompt=f"Go {i}", max_tokens=200, temperature=1.0, seed=i, model="tiny",
                                          extra_body=body).choices[0].text for i in range(3)]
    first = run()
    for text in first:
        valid_person(text)
    assert run() == first


def test_mixed_batch_of_32_validates_and_leaves_plain_requests_alone(client):
    kinds = ["json", "regex", "choice", None] * 8
    prompts = [f"Request {i}:" for i in range(len(kinds))]

    def run(i):
        body = ({"ignore_eos": True} if kinds[i] is None
                else {"structured_outputs": {kinds[i]: structured(kinds[i]), **COMPACT}})
        out = client.completions.create(prompt=prompts[i], max_tokens=60 if kinds[i] is None else 200,
                                        extra_body={**body, "return_token_ids": True}, **GREEDY)
        return out.choices[0].text, out.choices[0].token_ids

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, range(len(kinds))))
    for kind, (text, _) in zip(kinds, results):
        if kind is not None:
            check(kind, text)
    plain = [i for i, k in enumerate(kinds) if k is None]
    assert all(len(results[i][1]) == 60 for i in plain)
    assert [results[i][1] for i in plain] == [run(i)[1] for i in plain]  # the same tokens, run alone


@pytest.mark.parametrize("body, says", [
    ({"structured_outputs": {"json": {"type": "objec"}}}, "invalid JSON schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "invalid grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"choice": ["x" * MAX_GRAMMAR_BYTES]}}, "--max-grammar-bytes"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
])
def test_bad_grammars_are_400s_that_say_why(client, body, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt="x", max_tokens=5, extra_body=body, **GREEDY)
    assert says in e.value.body["message"] if isinstance(e.value.body, dict) else says in str(e.value)
    with pytest.raises(openai.BadRequestError):
        list(client.completions.create(prompt="x", max_tokens=5, extra_body=body, stream=True, **GREEDY))
    assert client.completions.create(prompt="still up", max_tokens=3, **GREEDY).choices[0].text is not None


def test_a_grammar_too_slow_to_compile_is_a_400_naming_the_timeout(client):
    """40 objects of 40 patterned strings: 88 KB, about 3.5 s to compile here, against a 1 s timeout."""
    patterned = {"type": "string", "pattern": "[a-z]{1,20}x"}
    inner = {"type": "object", "properties": {f"g{j}": patterned for j in range(40)}}
    slow = {"type": "object", "properties": {f"f{i}": inner for i in range(40)}}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt="x", max_tokens=5, extra_body={"structured_outputs": {"json": slow}}, **GREEDY)
    assert "--grammar-compile-timeout" in str(e.value)
    assert client.completions.create(prompt="still up", max_tokens=3, **GREEDY).choices[0].text is not None


# tool calls

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def valid_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "days"} and isinstance(value["city"], str) and len(value["city"]) <= 8
    assert isinstance(value["days"], int) and 1 <= value["days"] <= 9


def test_a_named_tool_choice_returns_arguments_that_validate_whole_and_streamed(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=64, **GREEDY)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "stop" and message.content == ""
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    valid_weather(call.function.arguments)

    chunks = list(client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=64,
                                                 stream=True, **GREEDY))
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert [tc.function.name for tc in calls if tc.id] == ["get_weather"]  # the header once, then fragments
    assert "".join(tc.function.arguments for tc in calls) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_required_tool_choice_calls_one_of_the_tools(client):
    whole = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
                                           **GREEDY)
    calls = whole.choices[0].message.tool_calls
    assert calls and whole.choices[0].finish_reason == "tool_calls"
    for call in calls:
        assert call.function.name in ("get_weather", "now")
        if call.function.name == "get_weather":
            valid_weather(call.function.arguments)
        else:
            assert json.loads(call.function.arguments) == {}
    single = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
                                            parallel_tool_calls=False, stream=True, **GREEDY)
    streamed = [tc for c in single if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert len(streamed) == 1 and streamed[0].function.name in ("get_weather", "now")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_hermes_blocks(client, stream):
    """With tool_choice auto the server reads the model's own <tool_call> blocks; a regex makes this random
    model write one, text before it included."""
    block = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Oslo|Rome)", "days": [1-3]\}\}'
             r'\n</tool_call>')
    kwargs = dict(messages=ASK, tools=TOOLS, max_tokens=120, extra_body={"structured_outputs": {"regex": block}},
                  **GREEDY)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
        names, arguments = [c.function.name for c in calls], [c.function.arguments for c in calls]
    else:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
        names = [tc.function.name for tc in deltas if tc.id]
        arguments = ["".join(tc.function.arguments for tc in deltas)]
        finish = chunks[-1].choices[0].finish_reason
    assert content.strip() == "Sure." and names == ["get_weather"] and finish == "tool_calls"
    valid_weather(arguments[0])


def test_a_tool_conversation_is_rendered_and_bad_tools_are_400(client, server):
    arguments = '{"city": "Oslo", "days": 1}'
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    reply = client.chat.completions.create(messages=conversation, tools=TOOLS, max_tokens=4, **GREEDY)
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1
    for extra, param in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                         ({"tool_choice": "sometimes"}, "tool_choice"),
                         ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
                         ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"messages": ASK, "tools": TOOLS, "max_tokens": 4, **GREEDY, **extra})
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=ASK, tool_choice="required", max_tokens=4, **GREEDY)
    assert e.value.body["param"] == "tool_choice"


def test_responses_call_a_forced_function_whole_and_streamed(client):
    """/v1/responses takes the flat function tools and returns function_call items (streamed: once the
    generation ended, with the arguments' events)."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    kwargs = dict(model="tiny", input="Weather in Oslo?", tools=tools, temperature=0.0, max_output_tokens=64,
                  tool_choice={"type": "function", "name": "get_weather"})
    whole = client.responses.create(**kwargs)
    (call,) = [o for o in whole.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and whole.status == "completed"
    valid_weather(call.arguments)
    with client.responses.stream(**kwargs) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "get_weather", call.arguments)]
    plain = client.responses.create(model="tiny", input="Hi", tools=tools, temperature=0.0, max_output_tokens=5)
    assert [o.type for o in plain.output] == ["message"] and plain.usage.output_tokens >= 1


def test_a_core_killed_mid_stream_resumes_the_grammar_from_the_tokens_streamed(client, server):
    """The replacement core rebuilds the request's grammar state from the tokens already streamed
    (AddRequest.output_token_ids): greedy, the text is the uninterrupted run's. Last: it replaces the core."""
    body = dict(prompt="List:", max_tokens=300, extra_body={"structured_outputs": {
        "json": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1000}, **COMPACT}}, **GREEDY)
    reference = client.completions.create(**body).choices[0].text
    assert reference.startswith('["')
    stream = client.completions.create(stream=True, **body)
    chunks = [next(stream)]
    server.kill("core-dp0")
    server.start_core(0)
    try:
        chunks += list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == reference
        assert "resubmitting its requests" in server.log("a0"), "the core finished before it was killed"
    finally:
        codes = server.stop()  # this test started the replacements: they end with it
    assert codes["core-dp0"] == 0, codes


def test_in_process_mode_serves_structured_outputs(tiny_model):
    """--no-multiprocessing: the engine core in the API server's process compiles and masks alike."""
    run_dir = Path(tempfile.mkdtemp(prefix="vsup-"))
    model = with_test_tokenizer(tiny_model("llama_tied"), run_dir / "model")
    d = LocalDeployment(model, run_dir, served_model_name="tiny", max_model_len=256, kv_cache_bytes=2 << 20)
    d.start(in_process=True)
    try:
        d.wait_ready()
        local = openai.OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0, timeout=120)
        out = local.completions.create(prompt="Pick:", max_tokens=20, extra_body={"structured_outputs": {
            "choice": CHOICES}}, **GREEDY)
        assert out.choices[0].text in CHOICES and out.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="invalid regex"):
            local.completions.create(prompt="x", max_tokens=5, extra_body={"structured_outputs": {"regex": "(("}},
                                     **GREEDY)
    finally:
        codes = d.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    assert all(code == 0 for code in codes.values()), codes

