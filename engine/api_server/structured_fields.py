"""The request fields that constrain output to a grammar: OpenAI's `response_format` and vLLM's
`structured_outputs`, turned into the engine's StructuredOutputs (or a 400).

Only their shape and size are checked here: the API server never loads
xgrammar (nor torch). The engine core compiles them, and a grammar that does
not compile, or compiles too slowly, ends its request before any token, which
the routes answer with a 400 quoting the compiler.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.api_server.errors import bad_request
from engine.wire.structured_outputs import StructuredOutputs


class _Fields(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)


class StructuredOutputsField(_Fields):
    """vLLM's `structured_outputs`: exactly one of json, json_object, regex, choice, grammar (EBNF)."""

    json_: str | dict | bool | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False


class JsonSchemaFormat(_Fields):
    """OpenAI's response_format.json_schema."""

    name: str = "response"
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Fields):
    """OpenAI's response_format: "text", "json_object" or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def structured_outputs_of(response_format: ResponseFormat | None, field: StructuredOutputsField | None,
                          max_bytes: int) -> StructuredOutputs | None:
    """The engine's constraint for a request (response_format wins over structured_outputs, as in vLLM);
    raises a 400 OpenAIError for a malformed or too large one."""
    param = "structured_outputs"
    compact = field is not None and field.disable_any_whitespace  # kept under a response_format, as vLLM does
    if response_format is not None and response_format.type != "text":
        param = "response_format"
        if response_format.type == "json_object":
            spec = StructuredOutputs(json_object=True, disable_any_whitespace=compact)
        elif response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise bad_request("response_format of type 'json_schema' needs json_schema.schema", param)
        else:
            spec = StructuredOutputs(json=json.dumps(response_format.json_schema.schema_),
                                     disable_any_whitespace=compact)
    elif field is not None:
        schema = field.json_
        spec = StructuredOutputs(
            json=schema if isinstance(schema, str) or schema is None else json.dumps(schema),
            json_object=bool(field.json_object), regex=field.regex,
            choice=tuple(field.choice) if field.choice is not None else None, grammar=field.grammar,
            disable_any_whitespace=compact)
    else:
        return None
    try:
        spec.validate()
    except ValueError as e:
        raise bad_request(str(e), param) from None
    if spec.num_bytes > max_bytes:
        raise bad_request(f"the {param} grammar is {spec.num_bytes} bytes, more than this server's limit of "
                          f"{max_bytes} (--max-grammar-bytes)", param)
    return spec
