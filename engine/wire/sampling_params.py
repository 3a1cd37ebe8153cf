"""What a request asks of the sampler: one immutable struct, also the wire format.

Plain msgspec, no torch: the API server builds and checks these without
importing the engine's tensors.
"""

from __future__ import annotations

import math

import msgspec

from engine.wire.structured_outputs import StructuredOutputs

# Below this temperature a row is sampled greedily: dividing logits by a
# near-zero number only overflows and changes nothing but the argmax.
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Per-request sampling settings, with OpenAI/vLLM meanings.

    temperature 0 means greedy; top_k -1 or 0 and top_p 1 and min_p 0 mean
    off; seed gives the request its own random stream (same seed, same
    tokens, whatever else is in the batch); max_tokens None means up to the
    context length; logprobs None returns none, n returns the sampled
    token's logprob plus the n most likely; prompt_logprobs does the same
    for every prompt token after the first (raw model logprobs); penalties 0 (1 for
    repetition_penalty) are off. `structured_outputs` constrains the output
    to a grammar (the engine core's business: the workers only see its
    bitmask). Call `validate()` on user input.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def is_greedy(self) -> bool:
        """True when the row takes the argmax instead of sampling."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when presence, frequency or repetition penalties change the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field and its allowed range."""
        _check(math.isfinite(self.temperature) and self.temperature >= 0,
               "temperature", self.temperature, "must be >= 0 (0 means greedy)")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", self.top_k, "must be -1 or 0 (off) or >= 1")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.seed is None or -2**63 <= self.seed < 2**64, "seed", self.seed,
               "must fit in 64 bits")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "must be >= 1 or null")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must be <= max_tokens ({self.max_tokens})")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               list(self.stop_token_ids), "must all be >= 0")
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", self.logprobs,
               "must be >= 0 or null")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs", self.prompt_logprobs,
               "must be >= 0 or null")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, value, "must be in [-2, 2]")
        _check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", self.repetition_penalty, "must be > 0 (1 means off)")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")
