"""The request body of POST /v1/responses (OpenAI's Responses API), and the conversation it makes.

Input is a string (one user message) or a list of items: messages ({"role", "content"}, content a
string or input_text / output_text parts), and a tool conversation's function_call and
function_call_output items. `instructions` comes first, as a system message. Not served (a 400 naming
the field): `previous_response_id` (no response is stored), `n` > 1, and content other than text.
Function tools ({"type": "function", "name", "parameters"}) and tool_choice work as on chat
completions, which they are turned into.
"""

from __future__ import annotations

import json

from pydantic import Field, model_validator

from engine.api_server.errors import bad_request
from engine.api_server.openai_models import MAX_LOGPROBS, SamplingFields, ToolUse

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(ToolUse, SamplingFields):
    """POST /v1/responses."""

    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = False
    metadata: dict | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    text: dict | None = None  # {"format": {"type": "text"}}

    @model_validator(mode="after")
    def _responses_supported(self):
        if self.previous_response_id is not None:
            raise bad_request("previous_response_id is not supported: responses are not stored; send the "
                              "conversation in input", "previous_response_id")
        if self.n != 1:
            raise bad_request("n must be 1 for /v1/responses", "n")
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if fmt.get("type") != "text":
            raise bad_request(f"text.format {fmt.get('type')!r} is not supported here; use 'text'", "text")
        if isinstance(self.input, str) and not self.input:
            raise bad_request("input is empty", "input")
        self._check_tools()
        return self

    def chat_tools(self) -> list[dict] | None:
        """The function tools in chat's shape ({"type": "function", "function": {...}})."""
        if not self.tools:
            return None
        return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                if isinstance(t, dict) and t.get("type") == "function" else t for t in self.tools]

    def chat_tool_choice(self):
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    def requested_logprobs(self) -> int | None:
        return None

    def messages(self) -> list[dict]:
        """The conversation as chat-template messages: instructions, then each input item."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            out.append(_message(item, f"input[{i}]"))
        if not out:
            raise bad_request("input is empty", "input")
        return out


def _message(item: dict, where: str) -> dict:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request(f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
        return {"role": role, "content": _text(item.get("content"), where)}
    if kind == "function_call":
        arguments = item.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise bad_request(f"{where}.arguments is not JSON", "input") from None
        return {"role": "assistant", "content": "", "tool_calls": [{
            "id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": parsed}}]}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "tool_call_id": item.get("call_id"),
                "content": output if isinstance(output, str) else json.dumps(output)}
    raise bad_request(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)",
                      "input")


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}.content: only text parts are supported, got {kind!r}", "input")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


