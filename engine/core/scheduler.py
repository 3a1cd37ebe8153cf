"""Continuous batching: which requests run each step, and how many tokens each computes.

Each step serves running requests first (decodes and unfinished prefill
chunks, in admission order), then admits waiting ones first come, first
served, while the token budget, max_num_seqs and free blocks allow. When a
running request needs a block and none is free, the most recently admitted
running request is preempted by recompute: its blocks are freed and it goes
back to the front of the queue, keeping its outputs, so that it resumes as a
NewRequest carrying prompt plus outputs.

The engine core alternates `schedule()` and `update_from_output()`.
`schedule()` advances num_computed_tokens as if the step will succeed;
`preempt_all()` undoes that when the worker group dies instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import msgspec

from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus, check_stop, stop_token_of
from engine.core.scheduler_config import SchedulerConfig
from engine.structured.compiler import GrammarError
from engine.structured.manager import StructuredOutputManager
from engine.wire.protocol import FinishReason, RequestUpdate, SchedulerStats
from engine.wire.scheduler_output import CachedRequest, ModelRunnerOutput, NewRequest, SchedulerOutput


class Scheduler:
    """Owns the request queues and the block manager of one engine core."""

    def __init__(self, config: SchedulerConfig, structured: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.structured = structured  # grammars of structured requests; None: this core refuses them
        self.block_manager = BlockManager(config.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.eos_token_ids = config.eos_token_ids
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []         # in admission order: the newest is preempted first
        self.num_preemptions = 0                 # by KV pressure; preempt_all() does not count
        self.num_kv_stalls = 0                   # steps that preempted or left a request waiting for blocks
        self.admitting = True                    # False while draining: running requests finish, none starts
        self._step_id = 0
        self._inflight_step_ids: set[int] = set()  # several with pipeline parallelism
        self._finished_req_ids: list[str] = []   # for the workers to drop, sent with the next step
        self._failed: list[RequestUpdate] = []   # finished while waiting (a grammar that failed), not yet said

    # --- requests in and out ---

    def add(self, request: Request) -> RequestUpdate | None:
        """Queue a request; if it can never run, finish it at once and return its "error" update."""
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in flight; ids must be unique")
        error = self._why_unschedulable(request)
        if error is None and request.sampling.structured_outputs is not None and self.structured is None:
            error = "this engine core serves no structured outputs"
        if error is not None:
            request.finish(FinishReason.ERROR, error)
            return RequestUpdate(request.req_id, finish_reason=request.finish_reason, error=error)
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self.waiting.append(request)
        if request.sampling.structured_outputs is not None:
            self.structured.add(request.req_id, request.sampling.structured_outputs)
        return None

    def abort(self, req_ids: Iterable[str]) -> list[RequestUpdate]:
        """Finish these requests with "abort" and free their blocks; unknown ids are ignored."""
        updates = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status is RequestStatus.WAITING:
                self.waiting.remove(request)
            else:
                self.running.remove(request)
            self._finish(request, FinishReason.ABORT)
            updates.append(RequestUpdate(req_id, finish_reason=FinishReason.ABORT))
        return updates

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting or running (while draining: running)."""
        return bool(self.running) if not self.admitting else bool(self.requests)

    def stats(self) -> SchedulerStats:
        """Queue lengths, KV use, prefix-cache and preemption counters, now."""
        bm = self.block_manager
        return SchedulerStats(len(self.running), len(self.waiting), bm.usage,
                              bm.prefix_cache_hit_rate, bm.num_queried_tokens, bm.num_hit_tokens,
                              self.num_preemptions)

    # --- one step ---

    def schedule(self, group: int = 0) -> SchedulerOutput:
        """Pick this step's requests and token counts, growing or preempting as blocks allow.

        With pipeline parallelism the engine core keeps one batch in flight per
        stage: each request belongs to one `group` (the batch it was admitted
        into), and a step schedules only its own group's running requests."""
        bm, budget = self.block_manager, self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_requests: list[NewRequest] = []
        cached_requests: list[CachedRequest] = []
        num_preemptions_before = self.num_preemptions
        waited_for_blocks = False

        # running: decodes and unfinished prefill chunks
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or request.group != group:  # its last sample has not come back yet
                i += 1
                continue
            if not self._make_room(request, num_new):
                break
            new_block_ids = bm.append_slots(request, num_new)
            cached_requests.append(CachedRequest(
                request.req_id, request.num_computed_tokens,
                request.token_ids[request.num_sent_tokens:], new_block_ids))
            request.num_sent_tokens = request.num_tokens
            num_scheduled[request.req_id] = num_new
            budget -= num_new
            i += 1

        # waiting: admitted in order, never past a preemption this step; those still compiling wait
        skipped: list[Request] = []
        while (self.admitting and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and self.num_preemptions == num_preemptions_before):
            request = self.waiting[0]
            if not self._is_grammar_ready(request):
                self.waiting.popleft()
                if not request.is_finished:
                    skipped.append(request)
                continue
            num_new = min(request.num_tokens - bm.num_cached_tokens(request), budget)
            if not bm.can_allocate(request, num_new):
                waited_for_blocks = True
                break
            self.waiting.popleft()
            block_ids = bm.allocate(request, num_new)
            request.status, request.group = RequestStatus.RUNNING, group
            self.running.append(request)
            new_requests.append(NewRequest(
                request.req_id, list(request.token_ids), request.num_prompt_tokens,
                _for_workers(request.sampling), list(block_ids), request.num_computed_tokens))
            request.num_sent_tokens = request.num_tokens
            num_scheduled[request.req_id] = num_new
            budget -= num_new

        self.waiting.extendleft(reversed(skipped))
        if waited_for_blocks or self.num_preemptions > num_preemptions_before:
            self.num_kv_stalls += 1
        self._step_id += 1
        for req_id, num_new in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += num_new
            self.requests[req_id].inflight_step = self._step_id
        self._inflight_step_ids.add(self._step_id)
        output = SchedulerOutput(self._step_id, new_requests, cached_requests, num_scheduled,
                                 list(self._finished_req_ids))
        if self.structured is not None:  # the rows that sample this step: those computed to their end
            output.grammar_bitmask = self.structured.bitmask(
                r for r in num_scheduled if self.requests[r].num_computed_tokens == self.requests[r].num_tokens)
        if num_scheduled:  # an empty step may never reach the workers: keep the ids for the next
            self._finished_req_ids.clear()
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Take a step's sampled tokens, apply the stop rules, and say what each request gained.

        Outputs of a step that preempt_all() has since voided are ignored.
        """
        if (scheduler_output.step_id not in self._inflight_step_ids
                or model_runner_output.step_id != scheduler_output.step_id):
            return []
        self._inflight_step_ids.discard(scheduler_output.step_id)
        out = model_runner_output
        index = {req_id: i for i, req_id in enumerate(out.req_ids)}
        prompt_logprobs = {chunk.req_id: chunk for chunk in out.prompt_logprobs}
        updates, self._failed = self._failed, []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if (request is None or request.status is not RequestStatus.RUNNING
                    or request.inflight_step != scheduler_output.step_id):
                continue  # aborted, or preempted and scheduled anew, while the step ran
            self.block_manager.cache_full_blocks(request)
            if req_id in prompt_logprobs and request.needs_prompt_logprobs:
                request.add_prompt_logprobs(prompt_logprobs[req_id].start, prompt_logprobs[req_id].logprobs)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk short of the end samples nothing
            i = index.get(req_id)
            if i is None:
                updates.append(self._fail(request, "the worker sampled no token for it"))
                continue
            token = out.sampled_token_ids[i]
            logprobs = out.logprobs[i] if i < len(out.logprobs) else None
            request.append_token(token)
            reason = check_stop(request, self.eos_token_ids, self.config.max_model_len)
            accepted = self.structured.accept(req_id, token) if self.structured is not None else None
            if accepted is False:
                updates.append(self._fail(request, f"the sampler chose token {token}, which its grammar refuses"))
                continue
            if accepted and self.structured.is_terminated(req_id):
                reason = FinishReason.STOP
            stop_token = stop_token_of(request, self.eos_token_ids) if reason is FinishReason.STOP else None
            if reason is not None:
                self._finish(request, reason)
            updates.append(RequestUpdate(req_id, [token], reason, [logprobs] if logprobs is not None else [],
                                         stop_reason=stop_token, prompt_logprobs=request.take_prompt_logprobs()))
        self.running = [r for r in self.running if not r.is_finished]
        return updates

    # --- preemption ---

    def preempt(self, request: Request) -> None:
        """Send a running request back to the front of the queue, to recompute its KV later."""
        self.running.remove(request)
        self.block_manager.free(request)
        self._requeue(request)
        self.num_preemptions += 1

    def preempt_all(self, num_blocks: int | None = None) -> list[RequestUpdate]:
        """Requeue every running request after its worker group died; all KV is gone.

        `num_blocks` is the new group's cache size (default: unchanged). Any
        request that no longer fits in it finishes with "error"; their
        updates are returned.
        """
        for request in reversed(self.running):
            self._requeue(request)
        self.running = []
        self.block_manager.reset(self.block_manager.num_blocks if num_blocks is None else num_blocks)
        self._inflight_step_ids.clear()
        self._finished_req_ids.clear()  # the new workers never knew them
        unfit = [r for r in self.waiting if self._why_unschedulable(r) is not None]
        for request in unfit:
            self.waiting.remove(request)
        return [self._fail(r, self._why_unschedulable(r)) for r in unfit]

    # --- internals ---

    def _make_room(self, request: Request, num_new_tokens: int) -> bool:
        """Preempt the newest running requests until `request` can grow; False if it went itself."""
        while not self.block_manager.can_append(request, num_new_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is request:
                return False
        return True

    def _requeue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """Mark done, free its blocks and forget it; the caller takes it off its queue."""
        request.finish(reason, error)
        self.block_manager.free(request)
        if self.structured is not None:
            self.structured.free(request.req_id)
        del self.requests[request.req_id]
        self._finished_req_ids.append(request.req_id)

    def _fail(self, request: Request, error: str) -> RequestUpdate:
        self._finish(request, FinishReason.ERROR, error)
        return RequestUpdate(request.req_id, finish_reason=FinishReason.ERROR, error=error)

    def _is_grammar_ready(self, request: Request) -> bool:
        """Whether a waiting request may be admitted as far as its grammar goes; one whose grammar
        failed is finished here, its update said with the next step's."""
        if self.structured is None or request.sampling.structured_outputs is None:
            return True
        try:
            return self.structured.is_ready(request.req_id, request.output_token_ids)
        except GrammarError as e:
            self._failed.append(self._fail(request, str(e)))
            return False

    def _why_unschedulable(self, request: Request) -> str | None:
        """Why `request` could never run, even alone with the whole cache, or None."""
        cfg, bm = self.config, self.block_manager
        if request.num_tokens > cfg.max_model_len:
            return (f"the request has {request.num_tokens} tokens, more than max_model_len "
                    f"{cfg.max_model_len}; shorten the prompt or serve with a larger --max-model-len")
        max_tokens = request.sampling.max_tokens
        final_len = min(cfg.max_model_len, request.num_prompt_tokens + (max_tokens or cfg.max_model_len))
        # The last sampled token is never computed, so its KV is never stored.
        num_kv_tokens = max(request.num_tokens, final_len - 1)
        if bm.num_blocks_for(num_kv_tokens) > bm.num_blocks:
            return (f"the request may need KV cache for {num_kv_tokens} tokens "
                    f"({bm.num_blocks_for(num_kv_tokens)} blocks of {bm.block_size}) but the cache "
                    f"holds only {bm.num_blocks} blocks; lower max_tokens or the prompt length, "
                    f"or give the KV cache more memory")
        return None


def _for_workers(sampling):
    """The workers see a grammar only as its bitmask: its source stays in the core."""
    if sampling.structured_outputs is None:
        return sampling
    return msgspec.structs.replace(sampling, structured_outputs=None)
