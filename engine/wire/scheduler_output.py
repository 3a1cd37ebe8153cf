"""What the engine core sends its workers each step, and what comes back.

The engine core is the one authority on tokens: a request's tokens reach the
workers in `NewRequest` (all its tokens so far) and then as `new_token_ids`
deltas, so every TP and PP rank holds the same view without asking anyone.
All of these cross a process boundary as msgpack (msgspec), never pickle.
"""

from __future__ import annotations

import msgspec

from engine.wire.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request scheduled for the first time, or again after preemption."""

    req_id: str
    token_ids: list[int]          # prompt plus the outputs so far (a resumed request recomputes them)
    num_prompt_tokens: int        # token_ids[num_prompt_tokens:] are outputs (penalties count them)
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0  # tokens whose KV is already cached (prefix cache hits)


class CachedRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the workers already know: only what changed since its last step."""

    req_id: str
    num_computed_tokens: int
    new_token_ids: list[int] = []   # tokens sampled since it was last scheduled
    new_block_ids: list[int] = []   # blocks appended to its block table


class GrammarBitmask(msgspec.Struct, array_like=True):
    """Which tokens each structured request of a step may sample: one row per `req_ids` entry,
    ceil(vocab / 32) little-endian int32 words a row, bit j of word w allowing token 32 * w + j."""

    req_ids: list[str]
    data: bytes


class SchedulerOutput(msgspec.Struct, tag="step", omit_defaults=True):
    """One step: which requests run and how many of their tokens each computes."""

    step_id: int
    new_requests: list[NewRequest] = []
    cached_requests: list[CachedRequest] = []
    num_scheduled_tokens: dict[str, int] = {}
    finished_req_ids: list[str] = []  # workers drop their state for these
    dummy: bool = False  # a one-token forward that touches no request and samples nothing (--dp-lockstep)
    grammar_bitmask: GrammarBitmask | None = None  # rows of the requests that sample under a grammar

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The sampled (or prompt) token's logprob and the top-n alternatives; `rank` is the token's
    rank in its distribution (1: the most likely), where known."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of prompt tokens `start`, `start + 1`, ... of one request (start >= 1: the first
    prompt token has none), from the prefill chunk that computed the positions before them."""

    req_id: str
    start: int
    logprobs: list[TokenLogprobs]


class ModelRunnerOutput(msgspec.Struct, tag="output", omit_defaults=True):
    """Sampled tokens of one step, from the sampling rank (last PP stage, TP rank 0).

    Only requests that reached the end of their known tokens sample; a
    prefill chunk that stops short returns nothing for its request, but
    the prompt logprobs of its positions when the request asked for them.
    """

    step_id: int
    req_ids: list[str] = []
    sampled_token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    prompt_logprobs: list[PromptLogprobs] = []
