"""How one chat completion's choices carry tool calls, whole and streamed (engine/api_server/tool_calls.py
reads them): not at all (no tools, or tool_choice "none"), from the model's own Hermes blocks ("auto"),
or from output a JSON schema forced (a named function, or "required").

finish_reason is "tool_calls" when an "auto" or "required" choice called a tool, and stays "stop" for a
named function, as OpenAI and vLLM have it.
"""

from __future__ import annotations

import json

from engine.api_server.tool_calls import HermesStream, forced_calls, new_call_id, parse_hermes

NONE, AUTO, NAMED, REQUIRED = "none", "auto", "named", "required"


class ChatTools:
    """The tool-call view of one request's choices; streaming state is kept per choice index."""

    def __init__(self, mode: str, tool_choice=None):
        self.mode, self.tool_choice = mode, tool_choice
        self.hermes: dict[int, HermesStream] = {}
        self.named_id: dict[int, str] = {}     # a named call's id, once its first fragment went out
        self.buffered: dict[int, str] = {}     # "required": the array, until it is whole
        self.called: set[int] = set()          # choices that streamed a call

    # whole

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a whole choice, and its finish_reason."""
        if self.mode == AUTO:
            content, calls = parse_hermes(text)
        elif self.mode in (NAMED, REQUIRED):
            calls = forced_calls(text, self.tool_choice)
            content = "" if calls and self.mode == NAMED else (None if calls else text)
        else:
            content, calls = text, []
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": content, "tool_calls": [c.to_json() for c in calls]}
        return message, self._finish(finish_reason, called=True)

    # streamed

    def delta(self, index: int, text: str, finish_reason: str | None) -> dict:
        """The OpenAI delta for `text` of choice `index` ({"content"} and/or {"tool_calls"}); {} for none."""
        final = finish_reason is not None
        if self.mode == AUTO:
            return self._merge(index, self.hermes.setdefault(index, HermesStream()).feed(text, final=final))
        if self.mode == NAMED:
            if not text:
                return {}
            self.called.add(index)
            if index in self.named_id:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            self.named_id[index] = new_call_id()
            return {"tool_calls": [{"index": 0, "id": self.named_id[index], "type": "function",
                                    "function": {"name": self.tool_choice["function"]["name"], "arguments": text}}]}
        if self.mode == REQUIRED:
            self.buffered[index] = self.buffered.get(index, "") + text
            if not final:
                return {}
            whole = self.buffered.pop(index)
            calls = forced_calls(whole, self.tool_choice)
            if not calls:  # cut short (max_tokens): the text as it came, as a whole choice has it
                return {"content": whole} if whole else {}
            self.called.add(index)
            return {"tool_calls": [{"index": i, **c.to_json()} for i, c in enumerate(calls)]}
        return {"content": text} if text else {}

    def finish_reason(self, index: int, finish_reason: str | None) -> str | None:
        """A streamed choice's finish_reason, given what it called."""
        return self._finish(finish_reason, called=index in self.called)

    def _finish(self, finish_reason: str | None, called: bool) -> str | None:
        if called and finish_reason == "stop" and self.mode in (AUTO, REQUIRED):
            return "tool_calls"
        return finish_reason

    def _merge(self, index: int, deltas: list[dict]) -> dict:
        out: dict = {}
        for d in deltas:
            if "content" in d:
                out["content"] = out.get("content", "") + d["content"]
            if "tool_calls" in d:
                self.called.add(index)
                out.setdefault("tool_calls", []).extend(d["tool_calls"])
        return out


def template_message(message: dict) -> dict:
    """A message for the chat template: an assistant's tool calls with their arguments as objects, which
    templates render with `tojson` (OpenAI sends them as JSON text)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    rendered = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the text as sent
        rendered.append({**call, "function": function})
    return {**message, "tool_calls": rendered}

