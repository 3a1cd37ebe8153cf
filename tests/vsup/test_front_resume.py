"""The front's pure rules for going on with a generation on a new tree (vsup/front/resume.py)."""

from __future__ import annotations

import json

from vsup.front.resume import CHAT, COMPLETION, Generation, charge, not_resumable, sse_events, stream_error


def chunk(ids, text, finish=None, prompt=None, kind=COMPLETION):
    choice = {"index": 0, "token_ids": ids, "finish_reason": finish}
    if kind == CHAT:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
        if prompt is not None:
            choice["prompt_token_ids"] = prompt
    out = {"id": "cmpl-1", "created": 7, "model": "tiny", "choices": [choice]}
    if kind == CHAT and prompt is not None:
        out["prompt_token_ids"] = prompt
    return out


def test_a_resumed_completion_sends_the_prompt_and_what_was_streamed_with_the_same_sampling():
    g = Generation(COMPLETION, {"model": "tiny", "prompt": "Once", "max_tokens": 10, "temperature": 0.7,
                                "seed": 3, "stop": ["\n\n"], "stream": True, "min_tokens": 4})
    route, first = g.upstream()
    assert route == "/v1/completions" and first["return_token_ids"] is True and first["prompt"] == "Once"
    g.on_chunk(chunk([5, 6], "a b", prompt=[1, 2, 3]))
    g.on_chunk(chunk([7], " c"))
    g.resumes = 1
    route, body = g.upstream()
    assert route == "/v1/completions"
    assert body["prompt"] == [1, 2, 3, 5, 6, 7] and body["max_tokens"] == 7 and body["min_tokens"] == 1
    assert (body["temperature"], body["seed"], body["stop"], body["stream"]) == (0.7, 3, ["\n\n"], True)
    assert "stream_options" not in body  # the client did not ask for usage


def test_the_client_never_sees_the_ids_it_did_not_ask_for_and_a_resumed_stream_keeps_its_id():
    g = Generation(COMPLETION, {"model": "tiny", "prompt": "Once", "max_tokens": 10, "stream": True})
    out = g.on_chunk(chunk([5], "a", prompt=[1, 2]))
    assert "token_ids" not in out["choices"][0] and "prompt_token_ids" not in out["choices"][0]
    g.resumes = 1
    later = {**chunk([6], " b"), "id": "cmpl-2", "created": 9}
    out = g.on_chunk(later)
    assert (out["id"], out["created"], out["choices"][0]["text"]) == ("cmpl-1", 7, " b")
    asked = Generation(COMPLETION, {"prompt": "x", "return_token_ids": True, "stream": True})
    assert asked.on_chunk(chunk([5], "a", prompt=[1]))["choices"][0]["token_ids"] == [5]


def test_a_chat_goes_on_as_a_completion_whose_chunks_are_chat_chunks_again():
    g = Generation(CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                          "max_completion_tokens": 5, "stream_options": {"include_usage": True}})
    g.on_chunk(chunk([], "", prompt=[1, 2, 3, 4], kind=CHAT))
    g.on_chunk(chunk([9, 8], "He llo", kind=CHAT))
    g.resumes = 1
    route, body = g.upstream()
    assert route == "/v1/completions" and body["prompt"] == [1, 2, 3, 4, 9, 8] and body["max_tokens"] == 3
    assert body["stream_options"] == {"include_usage": True}
    out = g.on_chunk({"id": "cmpl-9", "created": 1, "model": "tiny",
                      "choices": [{"index": 0, "text": "!", "token_ids": [7], "finish_reason": "stop"}]})
    assert out["object"] == "chat.completion.chunk" and out["choices"][0]["delta"] == {"content": "!"}
    assert out["choices"][0]["finish_reason"] == "stop" and "token_ids" not in out["choices"][0]
    usage = g.on_chunk({"id": "cmpl-9", "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 1}})
    assert usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}  # what the client got


def test_a_client_that_did_not_stream_gets_one_whole_response_counting_every_tree():
    g = Generation(CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    _, first = g.upstream()
    assert first["stream"] is True and "stream_options" not in first
    g.on_chunk(chunk([], "", prompt=[1, 2], kind=CHAT))
    g.on_chunk(chunk([3], "Par", kind=CHAT))
    g.resumes = 1
    g.on_chunk({"id": "x", "choices": [{"index": 0, "text": "is.", "token_ids": [4], "finish_reason": "stop"}]})
    assert g.on_chunk({"id": "x", "choices": [], "usage": {"prompt_tokens": 3}}) is None  # not asked for
    whole = g.response()
    assert whole["object"] == "chat.completion" and whole["id"] == "cmpl-1"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}
    assert whole["choices"][0]["finish_reason"] == "stop" and whole["usage"]["completion_tokens"] == 2


def test_what_cannot_go_on_from_token_ids_is_forwarded_as_it_is():
    assert not_resumable(COMPLETION, {"prompt": "x", "n": 2}) == "n > 1"
    assert not_resumable(CHAT, {"messages": [], "tools": [{"type": "function"}]}) == "tools"
    assert not_resumable(CHAT, {"messages": [], "logprobs": True}) == "logprobs"
    assert not_resumable(COMPLETION, {"prompt": ["a", "b"]}) == "a batch of prompts"
    assert not_resumable(COMPLETION, {"prompt": [1, 2, 3], "logprobs": 2}) is None
    assert not_resumable(CHAT, {"messages": [], "response_format": {"type": "text"}}) is None


def test_deaths_count_in_a_row_only_while_no_token_comes_out():
    g = Generation(COMPLETION, {"prompt": "x"})
    charge(g, probing_other=False)
    charge(g, probing_other=False)
    assert g.charges == 2  # a poison request: nothing came out between the deaths
    g.fresh_tokens = 3
    charge(g, probing_other=False)
    assert g.charges == 1  # it made progress on that tree: this death was not its doing
    g.fresh_tokens = 0
    charge(g, probing_other=True)
    assert g.charges == 1  # another request was probing that tree alone


def test_server_sent_events_are_taken_whole_and_error_chunks_carry_their_status():
    buffer = bytearray(b'data: {"a": 1}\n\ndata: [DONE]\n\ndata: {"par')
    assert sse_events(buffer) == [b'{"a": 1}', b"[DONE]"] and bytes(buffer) == b'data: {"par'
    assert stream_error(json.loads('{"error": {"message": "engine dead", "code": 500}}')) == 500
    assert stream_error({"error": {"message": "?"}}) == 500 and stream_error({"choices": []}) is None


def test_text_that_the_dead_tree_held_back_is_made_again_and_sent_once():
    """vLLM holds back the text of the last tokens while they may become a stop string: at the cut the
    client has " Once up" of the IDs [5, 6, 7] (" Once", " upon", " a"). The resume goes on from [5]
    (whose text the client has whole); the new tree makes " upon a" again, and the client gets " on a"."""
    g = Generation(CHAT, {"model": "tiny", "messages": [], "stream": True, "max_tokens": 6, "stop": ["upon a time"]})
    g.on_chunk(chunk([], "", prompt=[1, 2], kind=CHAT))
    g.on_chunk(chunk([5, 6], " Once up", kind=CHAT))
    g.on_chunk(chunk([7], "", kind=CHAT))
    assert g.rewindable
    g.resumes = 1
    g.rewind(1, " Once")
    route, body = g.upstream()
    assert body["prompt"] == [1, 2, 5] and body["max_tokens"] == 5  # the held-back tokens are made again
    out = [g.on_chunk(chunk([6], " upon")), g.on_chunk(chunk([7], " a")), g.on_chunk(chunk([8], " day"))]
    assert [c["choices"][0]["delta"]["content"] for c in out] == ["on", " a", " day"]
    assert "".join(g.text) == " Once upon a day" and g.generated == [5, 6, 7, 8]
    assert g.usage()["completion_tokens"] == 4
    shown = Generation(COMPLETION, {"prompt": "x", "return_token_ids": True, "stream": True})
    assert not shown.rewindable  # the client saw the IDs: it would get them twice


def test_the_likely_token_to_go_on_from_is_where_the_clients_text_stopped_as_much_earlier_as_was_held_back():
    """vLLM holds back as many characters after each chunk (a stop string's length less one, 3 here) of
    " Once", " upon", " a", " time": at the cut the client has " Once upon a t", and the text of the IDs
    of the last chunk after which it had 3 characters fewer or less is what it has of them whole."""
    g = Generation(COMPLETION, {"model": "tiny", "prompt": "x", "stream": True, "stop": ["@@@@"]})
    for ids, text in (([5], " O"), ([6], "nce u"), ([7], "po"), ([8], "n a t")):
        g.on_chunk(chunk(ids, text, prompt=[1]))
    assert g.marks == [(1, 2), (2, 7), (3, 9), (4, 14)]
    assert g.likely_keep(held=3) == 3  # [5, 6, 7] make " Once upon a", all of which the client has
    assert g.likely_keep(held=0) == 4 and g.likely_keep(held=99) is None
    g.rewind(3, " Once upon a")
    assert g.skip == 2 and g.marks[-1] == (3, 9)  # " time" is made again: the client gets "ime"


def test_a_whole_response_puts_the_asked_ids_where_vllm_does():
    """A completion's prompt_token_ids sit in its choice, a chat's at the top (the parity test found the
    completion's at the top)."""
    completion = Generation(COMPLETION, {"prompt": "x", "max_tokens": 2, "return_token_ids": True})
    completion.on_chunk(chunk([5, 6], "ab", finish="length", prompt=[1, 2]))
    whole = completion.response()
    assert whole["choices"][0]["prompt_token_ids"] == [1, 2] and "prompt_token_ids" not in whole
    assert whole["choices"][0]["token_ids"] == [5, 6]
    chat = Generation(CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "return_token_ids": True})
    chat.on_chunk(chunk([], "", prompt=[1, 2], kind=CHAT))
    chat.on_chunk(chunk([5], "a", finish="stop", kind=CHAT))
    whole = chat.response()
    assert whole["prompt_token_ids"] == [1, 2] and "prompt_token_ids" not in whole["choices"][0]
