"""The model's tokenizer and chat template, read from its directory with `tokenizers` and jinja2.

No transformers here: the API server must start fast and never import torch.
The chat template is rendered the way transformers renders it (a sandboxed
jinja2 environment with `trim_blocks`, `lstrip_blocks`, `raise_exception`
and `tojson`), then tokenized without adding special tokens again.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from engine import process
from engine.load import LoadMeter

# Longer texts are tokenized in a thread, so the event loop keeps streaming meanwhile.
THREAD_THRESHOLD_CHARS = 4096
# The nice value of those threads (Linux's is per thread; the `tokenizers` call releases the GIL): where
# tokenizing shares a CPU with the engine core, or with the event loop streaming others' tokens, it waits
TOKENIZER_NICE = 10


class TokenizerError(ValueError):
    """The text cannot be tokenized or the template cannot be rendered: the request's fault."""


class Tokenizer:
    """Encode, decode and render chat messages for one model directory."""

    def __init__(self, tokenizer: HFTokenizer, config: dict | None = None, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.config = config or {}
        self.chat_template = chat_template
        self.special_tokens = {name: _token_text(self.config.get(name))
                               for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None
        self.meter = LoadMeter()  # the API server's own, for `vsup ps` (time spent tokenizing)
        # long texts are tokenized on as many threads as the API server has CPUs (its placement, else
        # up to 4), at TOKENIZER_NICE: however many clients post long texts, tokenizing takes no more
        # CPU than that, and only what the step loop and the streams leave
        self.pool = ThreadPoolExecutor(process.threads(min(4, os.cpu_count() or 1)), thread_name_prefix="tokenize",
                                       initializer=os.nice, initargs=(TOKENIZER_NICE,))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json and chat_template.jinja (the last two optional)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir.name} has no tokenizer.json; the API server needs the "
                                    f"model's fast tokenizer file beside its weights")
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.is_file():
            template = jinja_path.read_text()
        return cls(HFTokenizer.from_file(str(path)), config, template)

    # text <-> tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; raises TokenizerError for text that is not valid Unicode."""
        try:
            with self.meter.busy("tokenize"):
                return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:  # lone surrogates and the like cannot cross into Rust
            raise TokenizerError(f"the text cannot be tokenized: {e}") from e

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, off the event loop for long texts."""
        if len(text) < THREAD_THRESHOLD_CHARS:
            return self.encode(text, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.encode, text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids; a broken UTF-8 sequence shows as U+FFFD."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (a partial character shows as U+FFFD)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary's own spelling of each token (transformers' convert_ids_to_tokens)."""
        return [self.tokenizer.id_to_token(t) or "" for t in token_ids]

    # chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """The prompt text of a conversation; raises TokenizerError if the template refuses it."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template (tokenizer_config.json has no "
                                 "chat_template); use /v1/completions with a prompt instead")
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        try:
            with self.meter.busy("tokenize"):
                return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                             **self.special_tokens, **kwargs)
        except Exception as e:  # raise_exception, or a TypeError from a message of the wrong shape
            raise TokenizerError(f"the chat template refused the messages: {e}") from e


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
