"""Tool calls (engine/api_server/tool_calls.py): the schema that forces a choice, and the model's Hermes
blocks read whole and as they stream, chunked every way."""

from __future__ import annotations

import json
import random

import pytest

from engine.api_server.tool_calls import (HermesStream, forced_calls, forced_schema, function_tools,
                                          parse_hermes)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"rive\\" {gauche}"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


def test_tools_are_checked_and_a_named_or_required_choice_becomes_a_schema():
    tools = function_tools(TOOLS)
    assert tools["get_weather"] == WEATHER and tools["now"] == {"type": "object", "properties": {}}
    for bad, message in (([{"type": "retrieval"}], "tools\\[0\\] must be"),
                         ([{"type": "function", "function": {"name": ""}}], "name must be"),
                         ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "parameters must")):
        with pytest.raises(ValueError, match=message):
            function_tools(bad)
    assert forced_schema(tools, "auto") is None and forced_schema(tools, "none") is None
    assert forced_schema(tools, {"type": "function", "function": {"name": "get_weather"}}) == WEATHER
    with pytest.raises(ValueError, match="'nope', which is not among the tools"):
        forced_schema(tools, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="not one of"):
        forced_schema(tools, "sometimes")
    required = forced_schema(tools, "required")
    assert required["minItems"] == 1 and "maxItems" not in required
    assert [o["properties"]["name"]["enum"] for o in required["items"]["anyOf"]] == [["get_weather"], ["now"]]
    assert forced_schema(tools, "required", parallel_tool_calls=False)["maxItems"] == 1


def test_the_output_of_a_forced_choice_is_its_calls():
    named = forced_calls('{"city": "Oslo"}', {"type": "function", "function": {"name": "get_weather"}})
    assert [(c.name, json.loads(c.arguments)) for c in named] == [("get_weather", {"city": "Oslo"})]
    required = forced_calls('[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": '
                            '{"city": "Rome"}}]', "required")
    assert [(c.name, json.loads(c.arguments)) for c in required] == [("now", {}), ("get_weather", {"city": "Rome"})]
    assert forced_calls('[{"name": "now", "param', "required") == []  # cut short by max_tokens
    assert required[0].id != required[1].id and required[0].to_json()["type"] == "function"


def test_hermes_blocks_read_whole():
    content, calls = parse_hermes(TEXT)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Paris "rive" {gauche}'}), ("now", {})]
    assert parse_hermes("plain text") == ("plain text", [])
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    content, calls = parse_hermes('<tool_call>{"name": "now", "arguments": {}}')  # no end tag: EOS came first
    assert content is None and [c.name for c in calls] == ["now"]


def streamed(text: str, cuts: list[int]) -> tuple[str, dict[int, dict]]:
    stream, deltas, last = HermesStream(), [], 0
    for cut in [*cuts, len(text)]:
        deltas += stream.feed(text[last:cut], final=cut == len(text))
        last = cut
    content, calls = "", {}
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        content += d.get("content", "")
        for call in d.get("tool_calls", []):
            got = calls.setdefault(call["index"], {"name": None, "arguments": "", "ids": set()})
            if "id" in call:
                assert got["name"] is None, "a call's header came twice"
                got["name"], got["ids"] = call["function"]["name"], {call["id"]}
            got["arguments"] += call["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("seed", range(40))
def test_hermes_blocks_streamed_in_any_chunks_give_the_same_calls(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, len(TEXT) - 1))) if seed else list(
        range(1, len(TEXT)))  # seed 0: one character at a time
    content, calls = streamed(TEXT, cuts)
    assert content.strip() == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": 'Paris "rive" {gauche}'}), ("now", {})]


def test_text_that_only_looks_like_a_tag_streams_as_content():
    content, calls = streamed("a <tool and <tool_cal", list(range(1, 21)))
    assert (content, calls) == ("a <tool and <tool_cal", {})
