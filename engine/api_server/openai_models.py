"""Request bodies of the OpenAI routes (and vLLM's extensions), as strict pydantic models that check
themselves and give the engine's SamplingParams.

Strict: a number sent as a string, a bool as a number, NaN or infinity is a
400, not a guess. Unknown fields are ignored, as vLLM does, so clients that
send newer OpenAI fields still work; a feature this server does not implement
is a 400 as the body is parsed, rather than ignored. Ranges that depend on the
model (max_tokens against max_model_len) are checked by `sampling_params`,
given the model's limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.api_server.errors import bad_request
from engine.api_server.structured_fields import ResponseFormat, StructuredOutputsField, structured_outputs_of
from engine.api_server.chat_tools import AUTO, NAMED, NONE, REQUIRED
from engine.api_server.tool_calls import forced_name, forced_schema, function_tools
from engine.args import DEFAULT_MAX_GRAMMAR_BYTES
from engine.wire.sampling_params import SamplingParams

MAX_N = 128
MAX_LOGPROBS = 20

TokenIds = list[Annotated[int, Field(ge=0)]]


@dataclass(frozen=True)
class ModelLimits:
    """What the served model allows a request: its context and its vocabulary."""

    max_model_len: int
    vocab_size: int
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES


def check_token_ids(token_ids, vocab_size: int, param: str) -> None:
    """400 unless every id is in the vocabulary (a bad id would crash the workers' embedding)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{param} must hold token ids in [0, {vocab_size}); got {bad[:5]}", param)


class OpenAIRequest(BaseModel):
    """Strict types, no NaN or infinity, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIRequest):
    """`include_usage`: a last chunk with the usage (and "usage": null in the others)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class SamplingFields(OpenAIRequest):
    """The fields both generation routes share."""

    model: str | None = Field(None, description="the served model name; the only one served if omitted")
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each prompt token's, and its top n
    return_token_ids: bool = False  # the choices' token_ids and the prompt_token_ids
    structured_outputs: StructuredOutputsField | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _supported(self):
        """Refuse, with a 400 (an OpenAIError passes through pydantic), what this server does not implement."""
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        if self.stream and self.prompt_logprobs:
            raise bad_request("prompt_logprobs are not available when stream=true", "prompt_logprobs")
        return self

    @property
    def include_usage(self) -> bool:
        """A last chunk with the usage (streaming)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> list[str]:
        """The stop strings as a list (empty strings would stop before anything)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return [s for s in stop if s]

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def requested_logprobs(self) -> int | None:
        """How many top logprobs per token the engine returns (None: no logprobs)."""
        raise NotImplementedError

    def requested_prompt_logprobs(self) -> int | None:
        """How many top logprobs per prompt token the engine returns (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def sampling_params(self, num_prompt_tokens: int, limits: ModelLimits) -> SamplingParams:
        """The engine's SamplingParams for one prompt of this request; raises a 400 OpenAIError."""
        max_model_len = limits.max_model_len
        if num_prompt_tokens == 0:
            raise bad_request("the prompt is empty; send at least one token", "prompt")
        if num_prompt_tokens >= max_model_len:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your "
                              f"prompt has {num_prompt_tokens} tokens, which leaves no room for the completion. "
                              f"Please reduce the length of the prompt.", "prompt")
        max_tokens = self.requested_max_tokens()
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens is None:
            max_tokens = max_model_len - num_prompt_tokens
        elif num_prompt_tokens + max_tokens > max_model_len:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you "
                              f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                              f"prompt, {max_tokens} for the completion). Please reduce the length of the prompt "
                              f"or max_tokens.", "max_tokens")
        check_token_ids(self.stop_token_ids or (), limits.vocab_size, "stop_token_ids")
        structured = structured_outputs_of(self.response_format, self.structured_outputs, limits.max_grammar_bytes)
        try:
            params = SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                # above the vocabulary top_k changes nothing, and past 2**63 it would overflow the sampler's int64
                top_k=-1 if self.top_k is None else min(self.top_k, limits.vocab_size),
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                logprobs=self.requested_logprobs(), prompt_logprobs=self.requested_prompt_logprobs(),
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                structured_outputs=structured)
            params.validate()
        except ValueError as e:
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from e
        return params


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """echo with logprobs lists the prompt tokens' logprobs too (vLLM: as many as logprobs asks)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


class ContentPart(OpenAIRequest):
    """A part of a message's content; only "text" parts are served."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class ChatMessage(OpenAIRequest):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, as a chat completion returned them
    tool_call_id: str | None = None       # a tool's answer: to which call


class ToolUse:
    """Tools and tool_choice, as a chat completion takes them (`chat_tools`, `chat_tool_choice`: the
    Responses API converts its own); a forced choice becomes the request's JSON schema."""

    def chat_tools(self) -> list[dict] | None:
        return self.tools

    def chat_tool_choice(self):
        return self.tool_choice

    def _check_tools(self) -> None:
        """400s for malformed tools or tool_choice; a forced choice becomes the request's JSON schema."""
        try:
            tools = function_tools(self.chat_tools() or [])
            forced_name(self.chat_tool_choice())
            schema = forced_schema(tools, self.chat_tool_choice(), self.parallel_tool_calls) if tools else None
        except ValueError as e:
            raise bad_request(str(e), "tool_choice" if "tool_choice" in str(e) else "tools") from None
        if self.tool_choice not in (None, "none", "auto") and not tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if schema is not None:
            if self.structured_outputs is not None or (self.response_format and self.response_format.type != "text"):
                raise bad_request(f"tool_choice {self.tool_choice!r} forces its own JSON schema: it cannot be "
                                  f"combined with response_format or structured_outputs", "tool_choice")
            # without free whitespace: arguments are for machines, and a model could pad them until max_tokens
            self.structured_outputs = StructuredOutputsField(json=schema, disable_any_whitespace=True)

    def tool_mode(self) -> str:
        """How the choices carry tool calls: none, auto, named or required (engine/api_server/chat_tools.py)."""
        if not self.chat_tools() or self.tool_choice == "none":
            return NONE
        if isinstance(self.tool_choice, dict):
            return NAMED
        return REQUIRED if self.tool_choice == "required" else AUTO

    def template_tools(self) -> list[dict] | None:
        """The tools the chat template shows the model (none under tool_choice "none")."""
        return self.chat_tools() if self.tools and self.tool_choice != "none" else None


class ChatCompletionRequest(ToolUse, SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # "none", "auto" (the default with tools), "required" or a function
    parallel_tool_calls: bool | None = None
    # vLLM's extensions
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _chat_supported(self):
        self._check_tools()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(OpenAIRequest):
    """POST /tokenize: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # the tokens' own strings too (the vocabulary's spelling)


class DetokenizeRequest(OpenAIRequest):
    """POST /detokenize."""

    model: str | None = None
    tokens: TokenIds
