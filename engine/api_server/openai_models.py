"""Request bodies of the OpenAI routes (and vLLM's extensions), as strict pydantic models.

Strict: a number sent as a string, a bool as a number, NaN or infinity is a
400, not a guess. Unknown fields are ignored, as vLLM does, so clients that
send newer OpenAI fields still work. Ranges that depend on the model
(max_tokens against max_model_len) are checked in sampling.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128
MAX_LOGPROBS = 20

TokenIds = list[Annotated[int, Field(ge=0)]]


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


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


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


class ResponseFormat(OpenAIRequest):
    """Only {"type": "text"} is served."""

    type: str


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    # vLLM's extensions
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None


class TokenizeRequest(OpenAIRequest):
    """POST /tokenize: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIRequest):
    """POST /detokenize."""

    model: str | None = None
    tokens: TokenIds
