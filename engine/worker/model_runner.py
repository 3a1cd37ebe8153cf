"""Turn one SchedulerOutput into a forward pass over this rank's shard, and sample.

The runner keeps what each request's tokens and blocks are (from NewRequest,
then CachedRequest deltas), so every TP and PP rank builds the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.distributed import ParallelGroups
from engine.model.attention import AttentionMetadata, allocate_kv_caches
from engine.model.llama import LlamaForCausalLM
from engine.sampling.grammar_bitmask import bitmask_from_bytes
from engine.sampling.prompt_logprobs import prompt_logprobs
from engine.sampling.sampler import (Sampler, SamplingMetadata, exponential_noise, greedy_tokens, make_generator,
                                     needs_only_argmax)
from engine.wire.sampling_params import SamplingParams
from engine.wire.scheduler_output import (GrammarBitmask, ModelRunnerOutput, PromptLogprobs, SchedulerOutput,
                                          TokenLogprobs)


@dataclass
class RequestState:
    """What this rank knows of one running request."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:  # without the copy of output_token_ids: asked every step
        return len(self.token_ids) - self.num_prompt_tokens


class ModelRunner:
    """Runs steps of one model shard over its paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, groups: ParallelGroups, block_size: int,
                 eos_token_ids: list[int], kv_cache_dtype: torch.dtype | None = None):
        self.model, self.groups = model, groups
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype or model.dtype
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None  # what min_tokens holds back
        self.device = groups.device
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.dummy_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # one scratch block: dummy steps

    def allocate_cache(self, num_blocks: int) -> int:
        """One key and one value cache per layer of this stage; returns their bytes.
        (Dummy steps write into a scratch block of their own, outside this count.)"""
        self.kv_caches = allocate_kv_caches(self.model.config, self.groups, num_blocks, self.block_size,
                                            self.kv_cache_dtype)
        self.dummy_kv_caches = allocate_kv_caches(self.model.config, self.groups, 1, self.block_size,
                                                  self.kv_cache_dtype)
        self.requests.clear()
        return sum(t.numel() * t.element_size() for pair in self.kv_caches for t in pair)

    # request state

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.new_requests:
            generator = make_generator(new.sampling.seed, self.device)
            if generator is not None and self.groups.is_driver:
                # a resumed request continues its random stream where it stopped
                for _ in range(len(new.token_ids) - new.num_prompt_tokens):
                    exponential_noise(torch.empty(1, self.model.config.vocab_size, device=self.device), [generator])
            self.requests[new.req_id] = RequestState(
                list(new.token_ids), new.num_prompt_tokens, new.sampling, list(new.block_ids),
                new.num_computed_tokens, generator)
        for cached in scheduler_output.cached_requests:
            state = self.requests[cached.req_id]
            state.token_ids += cached.new_token_ids
            state.block_ids += cached.new_block_ids
            state.num_computed_tokens = cached.num_computed_tokens

    # the step

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. Only the sampling rank returns the sampled tokens."""
        self.update_states(scheduler_output)
        if scheduler_output.dummy:
            self._dummy_forward()
            return ModelRunnerOutput(step_id=scheduler_output.step_id) if self.groups.is_driver else None
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput(step_id=scheduler_output.step_id) if self.groups.is_driver else None
        req_ids = list(scheduler_output.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        counts = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
        input_ids, positions = [], []
        for state, n in zip(states, counts):
            start = state.num_computed_tokens
            if start + n > len(state.token_ids):
                raise ValueError(f"step {scheduler_output.step_id} schedules {n} tokens from {start} but the request "
                                 f"has only {len(state.token_ids)}")
            input_ids += state.token_ids[start:start + n]
            positions += range(start, start + n)
        metadata = AttentionMetadata.build([s.num_computed_tokens for s in states], counts,
                                           [s.block_ids for s in states], self.block_size, self.device)
        input_ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)

        intermediate = None
        if not self.groups.is_first_stage:
            intermediate = self.groups.recv_intermediate(len(input_ids), self.model.config.hidden_size,
                                                         self.model.dtype)
        hidden = self.model(input_ids_t, positions_t, self.kv_caches, metadata, intermediate)
        if not self.groups.is_last_stage:
            for state, n in zip(states, counts):
                state.num_computed_tokens += n
            self.groups.send_intermediate(hidden)
            return None
        prompt = self._prompt_logprobs(req_ids, states, counts, hidden)
        for state, n in zip(states, counts):
            state.num_computed_tokens += n

        # only rows that reached the end of their known tokens sample
        sampling = [i for i, s in enumerate(states) if s.num_computed_tokens == len(s.token_ids)]
        last_rows = metadata.query_start_loc[1:] - 1
        logits = self.model.compute_logits(hidden[last_rows[sampling]]) if sampling else None
        if not self.groups.is_driver:
            return None
        if not sampling:
            return ModelRunnerOutput(step_id=scheduler_output.step_id, prompt_logprobs=prompt)
        output = self._sample(scheduler_output.step_id, [req_ids[i] for i in sampling],
                              [states[i] for i in sampling], logits, scheduler_output.grammar_bitmask)
        output.prompt_logprobs = prompt
        return output

    def _prompt_logprobs(self, req_ids: list[str], states: list[RequestState], counts: list[int],
                         hidden: torch.Tensor) -> list[PromptLogprobs]:
        """Logprobs of the prompt tokens that follow this step's positions, for requests that asked.
        Every TP rank of the last stage takes part (the head gathers the vocabulary); the driver's are kept."""
        out = []
        for req_id, state, n, row in zip(req_ids, states, counts, accumulate(counts, initial=0)):
            num_top = state.sampling.prompt_logprobs
            start = state.num_computed_tokens
            end = min(start + n, state.num_prompt_tokens - 1)  # position p predicts prompt token p + 1
            if num_top is None or end <= start:
                continue
            rows = hidden[row:row + end - start]
            logprobs = prompt_logprobs(rows, state.token_ids[start + 1:end + 1], num_top, self.model.compute_logits)
            if self.groups.is_driver:
                out.append(PromptLogprobs(req_id, start + 1, logprobs))
        return out

    def _dummy_forward(self) -> None:
        """One token (id 0, position 0) through this stage, as a real step goes: from the previous
        stage, to the next, through every TP collective, its K/V written into the scratch block,
        never into a request's. No logits, no sampling (vLLM's dummy run samples nothing either)."""
        metadata = AttentionMetadata.build([0], [1], [[0]], self.block_size, self.device)
        input_ids = torch.zeros(1, dtype=torch.long, device=self.device)
        positions = torch.zeros(1, dtype=torch.long, device=self.device)
        intermediate = None
        if not self.groups.is_first_stage:
            intermediate = self.groups.recv_intermediate(1, self.model.config.hidden_size, self.model.dtype)
        hidden = self.model(input_ids, positions, self.dummy_kv_caches, metadata, intermediate)
        if not self.groups.is_last_stage:
            self.groups.send_intermediate(hidden)

    def _sample(self, step_id: int, req_ids: list[str], states: list[RequestState],
                logits: torch.Tensor, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        has_grammar = grammar is not None and bool(grammar.req_ids)
        if not has_grammar and all(needs_only_argmax(s.sampling, s.num_output_tokens) for s in states):
            return ModelRunnerOutput(step_id=step_id, req_ids=req_ids, sampled_token_ids=greedy_tokens(logits).tolist())
        metadata = SamplingMetadata.from_params(
            [s.sampling for s in states], [s.output_token_ids for s in states], [s.generator for s in states],
            prompt_token_ids=[s.token_ids[:s.num_prompt_tokens] for s in states],
            eos_token_id=self.eos_token_id, device=self.device)
        if has_grammar:
            row_of = {req_id: i for i, req_id in enumerate(req_ids)}
            metadata.grammar_rows = torch.tensor([row_of[r] for r in grammar.req_ids], device=self.device)
            metadata.grammar_bitmask = bitmask_from_bytes(grammar.data, len(grammar.req_ids), self.device)
        result = self.sampler(logits.float(), metadata)
        logprobs: list[TokenLogprobs | None] = []
        for i, state in enumerate(states):
            n = state.sampling.logprobs
            if n is None or result.sampled_logprobs is None:
                logprobs.append(None)
                continue
            logprobs.append(TokenLogprobs(
                logprob=float(result.sampled_logprobs[i]),
                top_ids=result.top_token_ids[i, :n].tolist() if n else [],
                top_logprobs=result.top_logprobs[i, :n].tolist() if n else []))
        return ModelRunnerOutput(step_id=step_id, req_ids=req_ids,
                                 sampled_token_ids=result.sampled_token_ids.tolist(),
                                 logprobs=logprobs if any(lp is not None for lp in logprobs) else [])
