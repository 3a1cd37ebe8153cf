"""vLLM's extensions of the OpenAI routes, through the official client against a real API server,
engine core and worker on the tiny model: echo with logprobs, prompt_logprobs (checked against
transformers' log-softmax), stop_reason, return_token_ids, and /tokenize's token_strs."""

from __future__ import annotations


import httpx
import openai
import pytest

from tests.local_deployment import serve_tiny

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = dict(model="tiny", temperature=0.0)
TOLERANCE = 1e-4
PROMPT = "logprobs!"


@pytest.fixture(scope="module")
def server(tiny_model):
    yield from serve_tiny(tiny_model, served_model_name="tiny", max_model_len=256, kv_cache_bytes=2 << 20,
                          api_args=("--api-key", KEY), core_args=("--max-num-batched-tokens", "4"))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def tokenize(server, **body) -> dict:
    return httpx.post(f"{server.url}/tokenize", json=body, headers=AUTH).json()


@pytest.fixture(scope="module")
def reference(server, hf_logits):
    """The prompt's ids and transformers' log-softmax over them (row p predicts token p + 1)."""
    ids = tokenize(server, prompt=PROMPT)["tokens"]
    return ids, hf_logits(server.model_dir, ids).log_softmax(-1)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_lists_the_prompt_tokens_first(client, reference, stream):
    ids, logprobs = reference
    args = dict(prompt=PROMPT, max_tokens=5, logprobs=2, extra_body={"ignore_eos": True,
                                                                     "return_tokens_as_token_ids": True}, **GREEDY)
    plain = client.completions.create(**args).choices[0]
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(echo=True, stream=True, **args)]
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        token_logprobs = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
        top = [t for c in chunks if c.logprobs for t in c.logprobs.top_logprobs]
        offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    else:
        echoed = client.completions.create(echo=True, **args).choices[0]
        text, tokens, offsets = echoed.text, echoed.logprobs.tokens, echoed.logprobs.text_offset
        token_logprobs, top = echoed.logprobs.token_logprobs, echoed.logprobs.top_logprobs
    assert text == PROMPT + plain.text
    assert tokens == [f"token_id:{t}" for t in ids] + plain.logprobs.tokens
    assert token_logprobs[0] is None and top[0] is None
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]  # streamed too, as vLLM
    for p in range(1, len(ids)):
        row = logprobs[p - 1]
        assert token_logprobs[p] == pytest.approx(float(row[ids[p]]), abs=TOLERANCE)
        best = [f"token_id:{t}" for t in row.topk(2).indices.tolist()]
        assert set(best) <= set(top[p]) and f"token_id:{ids[p]}" in top[p] and len(top[p]) <= 3
    assert token_logprobs[len(ids):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-6)


def check_prompt_logprobs(entries: list, ids: list[int], logprobs, num_top: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        row, target = logprobs[p - 1], ids[p]
        entry = entries[p]
        assert next(iter(entry)) == str(target)  # the prompt token first, then the top n
        assert entry[str(target)]["logprob"] == pytest.approx(float(row[target]), abs=TOLERANCE)
        rank = entry[str(target)]["rank"]  # near-ties may order either way
        assert int((row > row[target] + TOLERANCE).sum()) < rank <= int((row > row[target] - TOLERANCE).sum()) + 1
        for rank, t in enumerate(row.topk(num_top).indices.tolist(), start=1):
            assert entry[str(t)]["rank"] == rank and isinstance(entry[str(t)]["decoded_token"], str)
        assert len(entry) in (num_top, num_top + 1)


def test_prompt_logprobs_of_completions_and_chat(client, server, reference, hf_logits):
    ids, logprobs = reference
    out = client.completions.create(prompt=PROMPT, max_tokens=3, extra_body={"prompt_logprobs": 3}, **GREEDY)
    check_prompt_logprobs(out.choices[0].prompt_logprobs, ids, logprobs, 3)
    assert out.choices[0].logprobs is None
    plain = client.completions.create(prompt=PROMPT, max_tokens=3, **GREEDY)
    assert plain.choices[0].text == out.choices[0].text and plain.choices[0].prompt_logprobs is None

    messages = [{"role": "user", "content": "hi there"}]
    chat_ids = tokenize(server, messages=messages)["tokens"]
    chat = client.chat.completions.create(messages=messages, max_tokens=3, n=2, extra_body={"prompt_logprobs": 0},
                                          **GREEDY)
    check_prompt_logprobs(chat.prompt_logprobs, chat_ids, hf_logits(server.model_dir, chat_ids).log_softmax(-1), 0)
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert "prompt_logprobs" not in chat.choices[0].model_extra


def test_stop_reason_names_the_stop_string_or_token(client):
    args = dict(prompt="abc", max_tokens=12, logprobs=0, **GREEDY)
    reference = client.completions.create(extra_body={"ignore_eos": True, "return_token_ids": True}, **args).choices[0]
    assert reference.finish_reason == "length" and reference.stop_reason is None
    stop_id = reference.token_ids[5]
    by_token = client.completions.create(extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}, **args)
    assert (by_token.choices[0].finish_reason, by_token.choices[0].stop_reason) == ("stop", stop_id)
    word = reference.text.strip().split()[-1]
    for stream in (False, True):
        kwargs = dict(extra_body={"ignore_eos": True}, stop=["zzzz", word], prompt="abc", max_tokens=12, **GREEDY)
        if stream:
            last = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)][-1]
        else:
            last = client.completions.create(**kwargs).choices[0]
        assert (last.finish_reason, last.stop_reason) == ("stop", word)
    chat_args = dict(messages=[{"role": "user", "content": "x"}], max_tokens=8, **GREEDY)
    chat_ref = client.chat.completions.create(extra_body={"ignore_eos": True, "return_token_ids": True}, **chat_args)
    chat_stop = chat_ref.choices[0].token_ids[2]
    chat = client.chat.completions.create(extra_body={"ignore_eos": True, "stop_token_ids": [chat_stop]}, **chat_args)
    assert (chat.choices[0].finish_reason, chat.choices[0].stop_reason) == ("stop", chat_stop)
    streamed = [c for c in client.chat.completions.create(stream=True, extra_body={
        "ignore_eos": True, "stop_token_ids": [chat_stop]}, **chat_args) if c.choices]
    assert (streamed[-1].choices[0].finish_reason, streamed[-1].choices[0].stop_reason) == ("stop", chat_stop)


def test_return_token_ids_in_completions_streamed_or_not(client, reference):
    ids, _ = reference
    args = dict(prompt=PROMPT, max_tokens=10, n=2, extra_body={"ignore_eos": True, "return_token_ids": True},
                **GREEDY)
    whole = client.completions.create(**args)
    as_ids = client.completions.create(prompt=PROMPT, max_tokens=10, logprobs=0, **GREEDY, extra_body={
        "ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0].logprobs.tokens
    for choice in whole.choices:
        assert choice.prompt_token_ids == ids and [f"token_id:{t}" for t in choice.token_ids] == as_ids
    chunks = [c for c in client.completions.create(stream=True, **args) if c.choices]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].prompt_token_ids == ids and all(c.prompt_token_ids is None for c in mine[1:])
        assert [t for c in mine for t in c.token_ids] == whole.choices[index].token_ids
    off = client.completions.create(prompt=PROMPT, max_tokens=2, **GREEDY).choices[0]
    assert off.token_ids is None and off.prompt_token_ids is None
    # vLLM: with return_token_ids, echo gives the prompt's ids and logprobs but not its text
    echoed = client.completions.create(echo=True, logprobs=0, **args).choices[0]
    assert echoed.text == whole.choices[0].text and echoed.prompt_token_ids == ids
    assert len(echoed.logprobs.tokens) == len(ids) + 10 and echoed.logprobs.token_logprobs[0] is None


def test_return_token_ids_in_chat_streamed_or_not(client, server):
    messages = [{"role": "user", "content": "ids"}]
    prompt_ids = tokenize(server, messages=messages)["tokens"]
    args = dict(messages=messages, max_tokens=10, extra_body={"ignore_eos": True, "return_token_ids": True}, **GREEDY)
    whole = client.chat.completions.create(**args)
    assert whole.prompt_token_ids == prompt_ids and len(whole.choices[0].token_ids) == 10
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": whole.choices[0].token_ids}, headers=AUTH)
    assert detok.json()["prompt"] == whole.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert chunks[0].prompt_token_ids == prompt_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks[1:] if c.choices for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    plain = client.chat.completions.create(messages=messages, max_tokens=2, **GREEDY)
    assert plain.prompt_token_ids is None and plain.choices[0].token_ids is None


def test_tokenize_returns_token_strs_when_asked(server):
    plain = tokenize(server, prompt="héllo")
    assert plain["token_strs"] is None
    asked = tokenize(server, prompt="héllo", return_token_strs=True)
    assert asked["tokens"] == plain["tokens"] and len(asked["token_strs"]) == len(asked["tokens"])
    assert asked["token_strs"][0] == "h" and asked["token_strs"][-3:] == ["l", "l", "o"]
    chat = tokenize(server, messages=[{"role": "user", "content": "a"}], return_token_strs=True)
    assert chat["token_strs"][0] == "<s>" and len(chat["token_strs"]) == chat["count"]
