"""A request as the scheduler sees it: its tokens, how far its KV is computed, how it ended."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from engine.wire.protocol import FinishReason
from engine.wire.sampling_params import SamplingParams
from engine.wire.scheduler_output import TokenLogprobs


class RequestStatus(enum.Enum):
    """Where a request is: in the waiting queue, in the running batch, or done."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Request:
    """One generation request: prompt plus outputs so far, and the scheduler's view of it.

    `output_token_ids` lets a caller resume a request whose first tokens were
    already produced elsewhere (an engine core that died); they count toward
    max_tokens and min_tokens as if generated here.
    """

    def __init__(self, req_id: str, prompt_token_ids: Sequence[int],
                 sampling: SamplingParams | None = None,
                 output_token_ids: Sequence[int] = ()) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {req_id!r} has an empty prompt; send at least one token")
        self.req_id = req_id
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.token_ids: list[int] = [*prompt_token_ids, *output_token_ids]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is computed, or scheduled to be this step
        self.num_sent_tokens = 0      # how many of token_ids the workers hold
        self.num_preemptions = 0
        self.group = 0                # which of the pipeline's batches it rides in (PP > 1)
        self.inflight_step: int | None = None  # the step that last scheduled it
        # Content hashes of the full blocks of token_ids, filled by the block
        # manager; tokens only ever append, so they stay valid across preemption.
        self.block_hashes: list[bytes] = []
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.prompt_logprobs: list[TokenLogprobs] = []  # of prompt tokens 1.. so far, until sent
        self.is_prompt_logprobs_sent = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and has not had them: its prefill must compute every position."""
        return self.sampling.prompt_logprobs is not None and not self.is_prompt_logprobs_sent

    def add_prompt_logprobs(self, start: int, logprobs: Sequence[TokenLogprobs]) -> None:
        """Keep a prefill chunk's prompt logprobs (those of prompt tokens start..); a recomputed
        chunk (after a preemption) brings what is already kept, and only the rest is taken."""
        have = len(self.prompt_logprobs) + 1
        if start <= have:
            self.prompt_logprobs += logprobs[have - start:]

    def take_prompt_logprobs(self) -> list[TokenLogprobs]:
        """The prompt logprobs for the request's first update, once; [] after that or if never asked."""
        if not self.needs_prompt_logprobs:
            return []
        taken, self.prompt_logprobs, self.is_prompt_logprobs_sent = self.prompt_logprobs, [], True
        return taken

    def append_token(self, token_id: int) -> None:
        """Add a sampled token; its KV is computed when the request is next scheduled."""
        self.token_ids.append(token_id)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """Mark the request done; the scheduler frees its blocks."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")


def check_stop(request: Request, eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
    """Why `request` must stop after its newest token, or None to go on.

    A stop token or EOS ends it only once it has min_tokens outputs. When the
    last allowed token is also a stop token, the reason is "stop": the model
    did stop there.
    """
    sampling = request.sampling
    last = request.token_ids[-1]
    if request.num_output_tokens >= sampling.min_tokens:
        if last in sampling.stop_token_ids or (not sampling.ignore_eos and last in eos_token_ids):
            return FinishReason.STOP
    if sampling.max_tokens is not None and request.num_output_tokens >= sampling.max_tokens:
        return FinishReason.LENGTH
    if request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def stop_token_of(request: Request, eos_token_ids: frozenset[int]) -> int | None:
    """The stop token id that ended `request` ("stop" on its newest token), None for EOS (vLLM's stop_reason)."""
    last, sampling = request.token_ids[-1], request.sampling
    if not sampling.ignore_eos and last in eos_token_ids:
        return None
    return last if last in sampling.stop_token_ids else None
