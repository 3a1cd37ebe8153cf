"""How a chat choice carries tool calls (engine/api_server/chat_tools.py), whole and streamed: the same
calls and the same finish_reason either way, and text that is no call stays text."""

from __future__ import annotations

import json

from engine.api_server.chat_tools import AUTO, NAMED, REQUIRED, ChatTools

NAMED_CHOICE = {"type": "function", "function": {"name": "f"}}


def streamed(tools: ChatTools, pieces: list[str], finish: str) -> tuple[str, list[dict], str]:
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        delta = tools.delta(0, piece, finish if i == len(pieces) - 1 else None)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            got = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            got["name"] = got["name"] or call.get("function", {}).get("name")
            got["arguments"] += call["function"]["arguments"]
    return content, list(calls.values()), tools.finish_reason(0, finish)


def test_required_and_named_give_the_same_calls_whole_and_streamed():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    message, finish = ChatTools(REQUIRED, "required").message(text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("f", {"a": 1}), ("g", {})]
    content, calls, finish = streamed(ChatTools(REQUIRED, "required"), [text[:9], text[9:30], text[30:]], "stop")
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"a": 1}), ("g", {})]
    message, finish = ChatTools(NAMED, NAMED_CHOICE).message('{"a": 2}', "stop")
    assert finish == "stop" and message["content"] == ""
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 2}'}
    content, calls, finish = streamed(ChatTools(NAMED, NAMED_CHOICE), ['{"a"', ": 2}"], "stop")
    assert (content, calls, finish) == ("", [{"name": "f", "arguments": '{"a": 2}'}], "stop")


def test_output_cut_short_stays_text_whole_and_streamed():
    cut = '[{"name": "f", "param'
    message, finish = ChatTools(REQUIRED, "required").message(cut, "length")
    assert message == {"role": "assistant", "content": cut} and finish == "length"
    assert streamed(ChatTools(REQUIRED, "required"), [cut[:5], cut[5:]], "length") == (cut, [], "length")
    message, finish = ChatTools(AUTO).message("no call here", "stop")
    assert message == {"role": "assistant", "content": "no call here"} and finish == "stop"
    assert streamed(ChatTools(AUTO), ["no call", " here"], "stop") == ("no call here", [], "stop")
