"""Logprobs in the two shapes OpenAI uses: the legacy completions one and the chat one."""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.api_server.tokenizer import Tokenizer
from engine.wire.scheduler_output import TokenLogprobs

# JSON has no -inf; vLLM and OpenAI clamp the same way
MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


def token_namer(tokenizer: Tokenizer, as_token_ids: bool = False):
    """How logprobs name a token: its text (a partial character shows as U+FFFD), or
    `token_id:<id>` (vLLM's return_tokens_as_token_ids, exact where text cannot be)."""
    return (lambda t: f"token_id:{t}") if as_token_ids else tokenizer.token_text


def completion_logprobs(name, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None],
                        text_offset: int = 0) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} for these tokens.

    `name` is a `token_namer`; `text_offset` is where the first token starts in the choice's text.
    """
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, logprobs):
        text = name(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top: dict[str, float] = {}
        for t, lp in zip(entry.top_ids, entry.top_logprobs):
            top.setdefault(name(t), _clamp(lp))  # tokens with the same text: the likeliest stays
        top.setdefault(text, _clamp(entry.logprob))  # the sampled token is always listed
        out["token_logprobs"].append(_clamp(entry.logprob))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(name, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None],
                  num_top: int) -> list[dict]:
    """The "content" list of a chat choice's logprobs: each token with its `num_top` alternatives."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        text = name(token_id)
        if entry is None:
            continue
        top = [_chat_entry(name(t), lp) for t, lp in
               zip(entry.top_ids[:num_top], entry.top_logprobs[:num_top])]
        content.append({**_chat_entry(text, entry.logprob), "top_logprobs": top})
    return content


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def prompt_logprobs_list(token_text, prompt_token_ids: Sequence[int],
                         logprobs: Sequence[TokenLogprobs]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token (nothing predicts it), then for each
    other a map from token id to {logprob, rank, decoded_token}: the prompt token first, then the top n."""
    out: list[dict | None] = [None]
    for token_id, entry in zip(prompt_token_ids[1:], logprobs):
        ranked = {str(token_id): _prompt_entry(token_text(token_id), entry.logprob, entry.rank)}
        for rank, (t, lp) in enumerate(zip(entry.top_ids, entry.top_logprobs), start=1):
            ranked.setdefault(str(t), _prompt_entry(token_text(t), lp, rank))
        out.append(ranked)
    return out


def _prompt_entry(text: str, logprob: float, rank: int | None) -> dict:
    return {"logprob": _clamp(logprob), "rank": rank, "decoded_token": text}
