"""Token ids to text, one token at a time, and stop strings that may span tokens.

Pure logic: the tokenizer comes in as a `decode(ids) -> str` function, so
these are tested against any tokenizer without a server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Tokens of the prompt decoded with the first outputs: a SentencePiece-style
# tokenizer decides a leading space from what precedes it.
NUM_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns the tokens of one output into text deltas whose concatenation is `decode(outputs)`.

    A multi-byte UTF-8 character split across tokens decodes to U+FFFD until
    its last byte arrives, so text that ends in U+FFFD is held back; `flush`
    gives whatever is left once the output ends. Each step decodes only the
    tokens since the last delta plus a little context, never the whole output.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_token_ids: Sequence[int] = ()):
        self.decode = decode
        self.token_ids: list[int] = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        # token_ids[prefix_offset:read_offset] were decoded already and serve as context
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, token_id: int) -> str:
        """Take one more token; return the text it completes (often "", never a broken character)."""
        self.token_ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """The text held back at the end of the output, even if it ends in U+FFFD."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self.decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # a special token that decodes to nothing, or a partial character
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return delta


class StopChecker:
    """Finds stop strings in streamed text, even across deltas, and never emits any part of one.

    The last `len(longest stop) - 1` characters are held back until the text
    after them shows they do not start a stop string. With
    `include_stop_str_in_output` the stop string itself is emitted (vLLM's
    extension); otherwise the output ends just before it.
    """

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self.stop = [s for s in stop if s]
        self.include = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.num_emitted = 0
        self.stopped_by: str | None = None

    def feed(self, delta: str, final: bool = False) -> tuple[str, bool]:
        """Add `delta`; return (text safe to emit now, whether a stop string ended the output).

        With `final` nothing more comes, so nothing is held back.
        """
        if self.stopped_by is not None:
            return "", True
        self.text += delta
        if self.stop and delta:
            start = max(0, len(self.text) - len(delta) - self.hold)
            # the stop completed first wins (then the one starting first): chunking cannot change it
            found = [(i + len(s), i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if found:
                _, index, stop = min(found)
                self.stopped_by = stop
                end = index + len(stop) if self.include else index
                return self._emit(end), True
        return self._emit(len(self.text) if final else len(self.text) - self.hold), False

    def _emit(self, end: int) -> str:
        if end <= self.num_emitted:
            return ""
        out = self.text[self.num_emitted:end]
        self.num_emitted = end
        return out
