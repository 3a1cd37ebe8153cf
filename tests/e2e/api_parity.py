"""The same requests to vLLM and to our engine, on the same weights: every field vLLM fills must be in
our answer with the same JSON type, and greedy texts must be equal (issue 21)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

GREEDY = {"model": "tiny", "temperature": 0}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# (route, body, whether the greedy text must be equal): what a client written against vLLM sends. (Not
# tool calls: a stock vLLM serves them only with --tool-call-parser.)
REQUESTS = [
    ("/v1/completions", {**GREEDY, "prompt": "The capital of France is", "max_tokens": 8}, True),
    ("/v1/completions", {**GREEDY, "prompt": "Paris is", "max_tokens": 6, "echo": True, "logprobs": 2}, True),
    ("/v1/completions", {**GREEDY, "prompt": "One, two,", "max_tokens": 12, "stop": [","],
                         "return_token_ids": True}, True),
    ("/v1/chat/completions", {**GREEDY, "messages": FRANCE, "max_tokens": 30, "logprobs": True, "top_logprobs": 2,
                              "return_token_ids": True}, True),
    ("/v1/chat/completions", {**GREEDY, "messages": FRANCE, "max_tokens": 40,
                              "response_format": {"type": "json_object"}}, False),
    ("/v1/completions", {**GREEDY, "prompt": "Pick a colour:", "max_tokens": 5,
                         "structured_outputs": {"choice": ["red", "green", "blue"]}}, True),
    ("/v1/responses", {**GREEDY, "input": "What is the capital of France?", "max_output_tokens": 30}, True),
    ("/tokenize", {"model": "tiny", "prompt": "Hello world", "return_token_strs": True}, True),
]
# what differs by nature: ids, times, the server's own fingerprints and bookkeeping
IGNORED = {"id", "created", "created_at", "system_fingerprint", "service_tier", "kv_transfer_params",
           "sequence_number", "call_id", "item_id", "max_model_len"}


def shape(value):
    """The JSON types of a value, down to the first element of each list; None where null."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items() if k not in IGNORED and v is not None}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def missing(theirs, ours, path="") -> list[str]:
    """Where `ours` lacks a field that `theirs` fills, or holds another type."""
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{path}: {ours!r} instead of an object"]
        return [m for k, v in theirs.items() for m in (missing(v, ours[k], f"{path}.{k}") if k in ours
                                                        else [f"{path}.{k}: absent"])]
    if isinstance(theirs, list):
        if not isinstance(ours, list):
            return [f"{path}: {ours!r} instead of a list"]
        return missing(theirs[0], ours[0], f"{path}[0]") if theirs and ours else []
    return [] if theirs == ours else [f"{path}: {ours} instead of {theirs}"]


def text_of(route: str, body: dict) -> str:
    if route == "/v1/completions":
        return json.dumps([c["text"] for c in body["choices"]])
    if route == "/v1/chat/completions":
        return json.dumps([c["message"].get("content") for c in body["choices"]])
    if route == "/v1/responses":
        return json.dumps([part["text"] for item in body["output"] for part in item.get("content", [])])
    return json.dumps([body["tokens"], body.get("token_strs")])


def compare(vllm_url: str, ours_url: str) -> list[str]:
    """Every difference found, as lines (empty when ours answers as vLLM does). Each request goes to both
    servers at once: they run on their own cores' share, and the test waits for the slower only."""
    problems = []
    with httpx.Client(timeout=120) as http, ThreadPoolExecutor(2) as pool:
        for route, request, same_text in REQUESTS:
            sent = [pool.submit(http.post, f"{url}{route}", json=request) for url in (vllm_url, ours_url)]
            theirs, ours = (answer.result() for answer in sent)
            name = f"{route} {sorted(set(request) - set(GREEDY))}"
            if theirs.status_code != 200 or ours.status_code != 200:
                problems.append(f"{name}: vLLM {theirs.status_code}, ours {ours.status_code}: {ours.text[:300]}")
                continue
            problems += [f"{name}: {m}" for m in missing(shape(theirs.json()), shape(ours.json()))]
            if same_text and text_of(route, theirs.json()) != text_of(route, ours.json()):
                problems.append(f"{name}: vLLM {text_of(route, theirs.json())}, ours {text_of(route, ours.json())}")
    return problems
