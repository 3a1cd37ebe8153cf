"""What a structured request constrains its output to, as vLLM's `structured_outputs` names it.

Plain msgspec, no torch, no xgrammar: the API server builds and checks these;
the engine core compiles them (engine/structured).
"""

from __future__ import annotations

import json

import msgspec

JSON_OBJECT_SCHEMA = '{"type": "object"}'


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Exactly one constraint: `json` (a JSON schema, as JSON text), `json_object` (any JSON object),
    `regex`, `choice` (one of these strings) or `grammar` (EBNF, xgrammar's GBNF dialect).
    `disable_any_whitespace`: JSON without whitespace between its tokens (else any, as the schema allows)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    @property
    def key(self) -> tuple[str, str]:
        """(kind, source) as the compiler takes it: kind is "json" (or "json-compact" without free
        whitespace), "regex" or "grammar"; equal keys share one compiled grammar."""
        json_kind = "json-compact" if self.disable_any_whitespace else "json"
        if self.json is not None:
            return json_kind, self.json
        if self.json_object:
            return json_kind, JSON_OBJECT_SCHEMA
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "grammar", choice_grammar(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        raise ValueError("structured_outputs needs one of json, json_object, regex, choice or grammar")

    @property
    def num_bytes(self) -> int:
        """The size of what the compiler gets, for --max-grammar-bytes."""
        return len(self.key[1].encode())

    def validate(self) -> None:
        """Raise ValueError unless exactly one constraint is set and well formed before compiling."""
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice needs at least one string")
        for name in ("regex", "grammar"):
            if "\x00" in (getattr(self, name) or ""):
                raise ValueError(f"structured_outputs.{name} must not contain a NUL character")


def choice_grammar(choice: tuple[str, ...] | list[str]) -> str:
    """An EBNF grammar whose only sentences are the given strings."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choice)


def _ebnf_literal(text: str) -> str:
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    body = "".join(escapes.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in text)
    return f'"{body}"'
