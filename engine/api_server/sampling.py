"""From an OpenAI request to the SamplingParams of each engine request, or a 400 that says why not.

Pure logic: the limits the model imposes (max_model_len, the vocabulary)
come in as arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from engine.api_server.errors import bad_request
from engine.api_server.openai_models import ChatCompletionRequest, CompletionRequest, SamplingFields
from engine.wire.sampling_params import SamplingParams

SEED_SPACE = 2**64


def stop_strings(req: SamplingFields) -> list[str]:
    """The request's stop strings as a list (empty strings would stop before anything)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    return [s for s in stop if s]


def check_unsupported(req: SamplingFields) -> None:
    """Refuse, with a 400, the OpenAI features this server does not implement, rather than ignore them."""
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if isinstance(req, CompletionRequest):
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
    if isinstance(req, ChatCompletionRequest):
        if req.response_format is not None and req.response_format.type != "text":
            raise bad_request(f"response_format {req.response_format.type!r} is not supported; use 'text'",
                              "response_format")
        if req.tools and req.tool_choice != "none":
            raise bad_request("tool calling is not supported", "tools")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """400 unless every id is in the vocabulary (a bad id would crash the workers' embedding)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{param} must hold token ids in [0, {vocab_size}); got {bad[:5]}", param)


def sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    num_prompt_tokens: int, max_model_len: int, vocab_size: int) -> SamplingParams:
    """The engine's SamplingParams for one prompt of `req`; raises a 400 OpenAIError."""
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty; send at least one token", "prompt")
    if num_prompt_tokens >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your "
                          f"prompt has {num_prompt_tokens} tokens, which leaves no room for the completion. "
                          f"Please reduce the length of the prompt.", "prompt")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt_tokens
    elif num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you "
                          f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                          f"{max_tokens} for the completion). Please reduce the length of the prompt or "
                          f"max_tokens.", "max_tokens")
    check_token_ids(req.stop_token_ids or (), vocab_size, "stop_token_ids")
    try:
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            # above the vocabulary top_k changes nothing, and past 2**63 it would overflow the sampler's int64
            top_k=-1 if req.top_k is None else min(req.top_k, vocab_size),
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, logprobs=logprobs,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty)
        params.validate()
    except ValueError as e:
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from e
    return params


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of the `index`-th of n choices: a seed gives each choice its own, repeatable stream."""
    if params.seed is None or index == 0:
        return params
    seed = params.seed + index
    if seed >= SEED_SPACE:
        seed -= SEED_SPACE
    return msgspec.structs.replace(params, seed=seed)
