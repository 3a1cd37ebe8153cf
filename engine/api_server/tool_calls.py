"""Tool calls of a chat completion, as OpenAI returns them. Pure: no I/O, no engine.

- `tool_choice` "required" and a named function are enforced with a JSON schema built from the
  tools (`forced_schema`), so they work with any model: the output is a JSON array of
  {"name", "parameters"} objects, or the named function's arguments alone (vLLM's convention).
- "auto" reads the model's own format: Hermes-style `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks (SmolLM2's and Qwen2's chat templates), whole (`parse_hermes`) or as the
  text streams (`HermesStream`), which yields OpenAI's `tool_calls` deltas.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`
    id: str = field(default_factory=new_call_id)

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# which tools, and how a choice is forced

def function_tools(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema of each function tool; ValueError naming what is malformed."""
    out = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[name] = parameters or {"type": "object", "properties": {}}
    return out


def forced_name(tool_choice) -> str | None:
    """The function a named `tool_choice` forces ({"type": "function", "function": {"name": ...}})."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if tool_choice.get("type") == "function" and isinstance(function, dict) and isinstance(
                function.get("name"), str):
            return function["name"]
        raise ValueError('tool_choice must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')
    if tool_choice not in (None, "none", "auto", "required"):
        raise ValueError(f'tool_choice {tool_choice!r} is not one of "none", "auto", "required" or a named function')
    return None


def forced_schema(tools: dict[str, dict], tool_choice, parallel_tool_calls: bool | None = None) -> dict | None:
    """The JSON schema that forces the choice: a named function's parameters, or for "required" an
    array of at least one {"name", "parameters"} call (at most one without parallel calls); None
    when nothing is forced."""
    name = forced_name(tool_choice)
    if name is not None:
        if name not in tools:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return tools[name]
    if tool_choice != "required":
        return None
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [n]}, "parameters": p}, "required": ["name", "parameters"]}
        for n, p in tools.items()]}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, tool_choice) -> list[ToolCall]:
    """The calls in the output of a forced choice (named: the arguments; required: the array)."""
    name = forced_name(tool_choice)
    if name is not None:
        return [ToolCall(name, text)]
    try:
        calls = json.loads(text)
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    except (ValueError, KeyError, TypeError):  # cut short by max_tokens: no calls, the text stays content
        return []


# "auto": the model's own Hermes-style blocks

def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the first call, or None when empty; the calls). Text with a block that is not a
    call's JSON is all content, as is text without any block."""
    if START not in text:
        return text, []
    calls = []
    for block in re.findall(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", text, flags=re.DOTALL):
        call = _call(block)
        if call is None:
            return text, []
        calls.append(call)
    content = text[:text.index(START)].strip()
    return content or None, calls


def _call(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
        name, arguments = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str):
        return None
    return ToolCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


class HermesStream:
    """Turns streamed text into OpenAI chat deltas: {"content": ...} for text outside the blocks, and
    {"tool_calls": [...]} for each block: the call's id, type and name once its name is known, then its
    arguments in fragments as they stream (their concatenation is the arguments' JSON text)."""

    def __init__(self):
        self.buffer = ""       # text not yet turned into deltas
        self.in_call = False
        self.index = -1        # the current call's index
        self.named = False     # its header delta went out
        self.args_sent = 0     # how much of its arguments' text went out
        self.num_calls = 0
        self.id = ""           # the current call's id

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """The deltas for `text`; `final` at the end of the output (flushes what was held back)."""
        self.buffer += text
        deltas = []
        while True:
            if not self.in_call:
                at = self.buffer.find(START)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, START)
                    emit, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    if emit and (self.num_calls == 0 or emit.strip()):
                        deltas.append({"content": emit})
                    return deltas
                if self.buffer[:at] and (self.num_calls == 0 or self.buffer[:at].strip()):
                    deltas.append({"content": self.buffer[:at]})
                self.buffer = self.buffer[at + len(START):]
                self.in_call, self.index, self.named, self.args_sent = True, self.index + 1, False, 0
                self.num_calls += 1
                self.id = new_call_id()
            end = self.buffer.find(END)
            block = self.buffer[:end] if end >= 0 else self.buffer[:len(self.buffer) - (
                0 if final else _partial_suffix(self.buffer, END))]
            deltas.extend(self._call_deltas(block, done=end >= 0 or final))
            if end < 0:
                return deltas
            self.buffer, self.in_call = self.buffer[end + len(END):], False

    def _call_deltas(self, block: str, done: bool) -> list[dict]:
        out = []
        if not self.named:
            name = _NAME.search(block)
            if name is None:
                return out
            self.named = True
            out.append(self._delta({"id": self.id, "type": "function",
                                    "function": {"name": json.loads(f'"{name.group(1)}"'), "arguments": ""}}))
        args = _ARGUMENTS.search(block)
        if args is None:
            call = _call(block) if done else None
            if call is not None and self.args_sent == 0:  # "arguments" came before "name", or a string
                out.append(self._delta({"function": {"arguments": call.arguments}}))
            return out
        # the outer object's closing brace follows the arguments: held back, with trailing space, always, so
        # that what went out is a prefix of the whole
        raw = block[args.end():].rstrip()
        if raw.endswith("}"):
            raw = raw[:-1].rstrip()
        if len(raw) > self.args_sent:
            out.append(self._delta({"function": {"arguments": raw[self.args_sent:]}}))
            self.args_sent = len(raw)
        return out

    def _delta(self, call: dict) -> dict:
        return {"tool_calls": [{"index": self.index, **call}]}


def _partial_suffix(text: str, tag: str) -> int:
    """How many of `text`'s last characters could begin `tag` (held back until the next text says)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
