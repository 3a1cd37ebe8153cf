"""Resuming a generation on a new vLLM tree from token IDs. Pure.

The front asks vLLM for `return_token_ids`, so every streamed chunk says which
token IDs it carries, and the first says the prompt's. When the tree dies, the
request goes on as a completion whose prompt is the prompt's IDs plus every ID
already streamed, with `max_tokens` reduced by those and the same sampling
parameters. A chat request continues the same way, its chunks turned back into
chat chunks. What the client did not ask for (the IDs, a usage chunk) is taken
out of what it receives; `usage` counts the tokens the client got.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

COMPLETION, CHAT = "completion", "chat"
ROUTES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}

# what a completion resumed from IDs keeps of the original request
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words",
            "allowed_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
            "include_stop_str_in_output", "priority", "user")


def not_resumable(kind: str, body: dict) -> str | None:
    """Why this request cannot go on from its token IDs on another tree (None: it can)."""
    if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
        return "n > 1"
    for key in ("tools", "functions", "response_format", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "prompt_logprobs", "suffix", "echo"):
        if body.get(key) not in (None, False, [], {}) and not (key == "response_format" and
                                                                 (body[key] or {}).get("type") == "text"):
            return key
    if kind == CHAT and (body.get("logprobs") or body.get("top_logprobs")):
        return "logprobs"
    if kind == COMPLETION:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return "a batch of prompts"
    return None


def limit_of(kind: str, body: dict) -> int | None:
    """The most tokens the client asked for (vLLM's completions default to 16, chat to the context)."""
    if kind == CHAT:
        return body.get("max_completion_tokens", body.get("max_tokens"))
    return body.get("max_tokens", 16)


@dataclass
class Generation:
    """One client's generation as the front holds it, across the trees it ran on. The front always
    streams from vLLM; a client that did not ask for a stream gets the whole response at the end."""

    kind: str
    body: dict
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # a completion's, chunk by chunk
    id: str | None = None
    created: int | None = None
    model: str | None = None
    finish_reason: str | None = None
    stop_reason: object = None
    resumes: int = 0  # how many times it went on on a new tree
    charges: int = 0  # deaths in a row it was running at without a token coming out of it
    fresh_tokens: int = 0  # tokens since its last (re)submission
    usage_sent: bool = False
    dead: set[int] = field(default_factory=set)  # the gens of the trees that died under it
    skip: int = 0  # characters of the resumed stream's text that the client already got (see rewind)
    checked: int = -1  # how many generated IDs the last look at held-back text saw
    chars: int = 0  # characters of text the client got
    marks: list[tuple[int, int]] = field(default_factory=list)  # (IDs, chars) after each chunk

    @property
    def wants_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    @property
    def streams(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def wants_usage(self) -> bool:
        return self.streams and bool((self.body.get("stream_options") or {}).get("include_usage"))

    @property
    def resumed(self) -> bool:
        return self.resumes > 0

    def upstream(self) -> tuple[str, dict]:
        """The route and body to send now: the client's request as a stream with IDs, or its continuation."""
        if not self.resumed or self.prompt_ids is None:
            body = {**self.body, "stream": True, "return_token_ids": True}
            if not self.streams:
                body.pop("stream_options", None)
            return ("/v1/chat/completions" if self.kind == CHAT else "/v1/completions"), body
        body = {key: self.body[key] for key in SAMPLING if key in self.body}
        if "min_tokens" in self.body:
            body["min_tokens"] = max(0, self.body["min_tokens"] - len(self.generated))
        if self.kind == COMPLETION and self.body.get("logprobs") is not None:
            body["logprobs"] = self.body["logprobs"]
        body.update(model=self.body.get("model"), prompt=[*self.prompt_ids, *self.generated],
                    max_tokens=self.remaining(), stream=True, return_token_ids=True)
        if self.wants_usage:
            body["stream_options"] = {"include_usage": True}
        return "/v1/completions", body

    @property
    def rewindable(self) -> bool:
        """Whether it may go on from fewer IDs than were streamed: only if the client never saw the IDs
        (nor their logprobs), since it would get those tokens again."""
        return not self.wants_ids and not self.logprobs and not self.body.get("logprobs")

    def rewind(self, keep: int, voiced: str) -> None:
        """Go on from the first `keep` generated IDs, whose text `voiced` the client got (a prefix of all it
        got). vLLM holds back the text of the last tokens while it may still turn out to be a stop string,
        or an incomplete character: the new tree makes those tokens again, and of their text the client
        is sent only what it does not have yet."""
        self.skip = self.chars - len(voiced)
        del self.generated[keep:]
        self.marks = [mark for mark in self.marks if mark[0] <= keep]

    def likely_keep(self, held: int) -> int | None:
        """How many IDs to go on from when vLLM held back the last `held` characters of their text: those
        streamed by the last chunk after which the client had `held` characters fewer than it has now (vLLM
        holds back as many after each chunk, while the text is longer than a stop string); None if none."""
        return next((ids for ids, chars in reversed(self.marks) if chars + held <= self.chars), None)

    def remaining(self) -> int | None:
        limit = limit_of(self.kind, self.body)
        return None if limit is None else limit - len(self.generated)

    def on_chunk(self, chunk: dict) -> dict | None:
        """Note what an upstream chunk carries; the chunk to stream to the client, or None for none."""
        choices = chunk.get("choices") or []
        if self.id is None:
            self.id, self.created, self.model = chunk.get("id"), chunk.get("created"), chunk.get("model")
        if self.prompt_ids is None:
            ids = chunk.get("prompt_token_ids") or (choices[0].get("prompt_token_ids") if choices else None)
            if ids is not None:
                self.prompt_ids = list(ids)
        if self.skip and choices:
            choices = chunk["choices"] = [self._skipped(c) for c in choices]
        for choice in choices:
            ids = choice.get("token_ids") or []
            self.generated.extend(ids)
            self.fresh_tokens += len(ids)
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                self.text.append(text)
                self.chars += len(text)
            if self.kind == COMPLETION and choice.get("logprobs"):
                self.logprobs.append(choice["logprobs"])
            if choice.get("finish_reason") is not None:
                self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        if choices:
            self.marks.append((len(self.generated), self.chars))
        if not choices and chunk.get("usage") is not None:
            self.usage_sent = self.wants_usage
            return {**self._head(), "choices": [], "usage": self.usage()} if self.wants_usage else None
        if self.resumed and self.kind == CHAT:
            return {**self._head(), "choices": [self._chat_choice(c) for c in choices]}
        if self.resumed:
            chunk = {**chunk, **self._head()}
        return chunk if self.wants_ids else strip_ids(chunk)

    def _skipped(self, choice: dict) -> dict:
        """The choice without the first characters of its text that the client already got."""
        completion = "text" in choice
        text = choice["text"] if completion else (choice.get("delta") or {}).get("content")
        if not text:
            return choice
        cut = min(self.skip, len(text))
        self.skip -= cut
        if completion:
            return {**choice, "text": text[cut:]}
        return {**choice, "delta": {**choice["delta"], "content": text[cut:]}}

    def _head(self, streamed: bool = True) -> dict:
        obj = ("chat.completion.chunk" if streamed else "chat.completion") if self.kind == CHAT else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chat_choice(self, choice: dict) -> dict:
        out = {"index": choice.get("index", 0), "delta": {"content": choice.get("text", "")}, "logprobs": None,
               "finish_reason": choice.get("finish_reason")}
        if "stop_reason" in choice:
            out["stop_reason"] = choice["stop_reason"]
        if self.wants_ids:
            out["token_ids"] = choice.get("token_ids")
        return out

    def usage(self) -> dict:
        prompt = len(self.prompt_ids or ())
        return {"prompt_tokens": prompt, "completion_tokens": len(self.generated),
                "total_tokens": prompt + len(self.generated)}

    def finished_here(self) -> dict:
        """The last chunk, when every token the client asked for came out before the tree died."""
        self.finish_reason = "length"
        choice = {"index": 0, "finish_reason": "length"}
        choice.update({"delta": {}} if self.kind == CHAT else {"text": ""})
        return {**self._head(), "choices": [{**choice, "logprobs": None}]}

    def response(self) -> dict:
        """The whole response, for a client that did not stream."""
        text = "".join(self.text)
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": self.finish_reason,
                        "stop_reason": self.stop_reason}
        if self.kind == CHAT:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
            if self.logprobs:
                choice["logprobs"] = {key: [x for part in self.logprobs for x in part.get(key) or ()]
                                      for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}
        if self.wants_ids:
            choice["token_ids"] = list(self.generated)
            if self.kind != CHAT:  # vLLM's places: a completion's choice, a chat response's top
                choice["prompt_token_ids"] = list(self.prompt_ids or ())
        out = {**self._head(streamed=False), "choices": [choice], "usage": self.usage()}
        if self.wants_ids and self.kind == CHAT:
            out["prompt_token_ids"] = list(self.prompt_ids or ())
        return out


def strip_ids(chunk: dict) -> dict:
    """The chunk without the token IDs that the front asked for and the client did not."""
    chunk = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
    if chunk.get("choices"):
        chunk["choices"] = [{k: v for k, v in c.items() if k not in ("token_ids", "prompt_token_ids")}
                            for c in chunk["choices"]]
    return chunk


def stream_error(chunk: dict) -> int | None:
    """The status an error chunk in the middle of a stream carries (vLLM sends one when its engine died)."""
    error = chunk.get("error")
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    return code if isinstance(code, int) else 500


def sse_events(buffer: bytearray) -> list[bytes]:
    """Take the complete server-sent events out of `buffer` (their `data:` payloads), leaving a partial one."""
    events = []
    while True:
        end = buffer.find(b"\n\n")
        if end < 0:
            return events
        block = bytes(buffer[:end])
        del buffer[:end + 2]
        data = b"\n".join(line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:"))
        if data:
            events.append(data)


def sse(chunk: dict) -> bytes:
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def charge(gen: Generation, probing_other: bool) -> None:
    """A tree died while `gen` ran on it. Deaths count in a row only while no token comes out of it: a
    request that keeps killing the engine (a poison request) is told apart from one that was only there.
    A death while another request was probing the tree alone is that one's, not this one's."""
    if probing_other:
        return
    gen.charges = 1 if gen.fresh_tokens else gen.charges + 1
