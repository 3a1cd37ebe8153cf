"""`EngineCore`: the scheduler and the step loop of one DP rank, in whatever process holds it.

`EngineCoreProc` wraps it as its own process with sockets; in-process mode
(VSUP_ENABLE_MULTIPROCESSING=0) calls it directly, step by step.
"""

from __future__ import annotations

from collections import deque

import structlog

from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.executor.executor import Executor
from engine.structured.manager import StructuredOutputManager
from engine.wire.protocol import AddRequest, FinishReason, RequestUpdate, SchedulerStats
from engine.wire.scheduler_output import ModelRunnerOutput, SchedulerOutput

log = structlog.get_logger("engine-core")


class EngineCore:
    """Takes requests, runs steps on its executor, returns what each request gained."""

    def __init__(self, config: SchedulerConfig, executor: Executor | None, vocab_size: int,
                 num_batches_in_flight: int = 1, structured: StructuredOutputManager | None = None):
        """`num_batches_in_flight` is the pipeline-parallel size: one batch per stage, so that
        stage 0 computes the next batch while the later stages finish this one. Without `structured`
        the core refuses requests with structured_outputs."""
        self.config = config
        self.vocab_size = vocab_size
        self.scheduler = Scheduler(config, structured)
        self.executor = executor
        self.num_steps = 0        # steps that ran a batch of requests
        self.num_dummy_steps = 0  # --dp-lockstep: steps with no request, to keep in step with other ranks
        self.num_requests = 0     # requests taken (a resubmission counts again)
        self.num_groups = num_batches_in_flight
        self.inflight: deque[tuple[int, SchedulerOutput]] = deque()  # (group, step) in submission order
        self.next_group = 0

    # requests

    def add_request(self, add: AddRequest) -> RequestUpdate | None:
        """Queue a request, or finish it at once with an error that says what is wrong with it.

        No request, however malformed, reaches the workers unchecked: a bad
        token id would crash the embedding lookup of every rank.
        """
        try:
            add.sampling.validate()
            if add.sampling.top_k > self.vocab_size:
                raise ValueError(f"top_k must be at most the vocabulary size {self.vocab_size}, got {add.sampling.top_k}")
            bad = [t for t in (*add.prompt_token_ids, *add.output_token_ids) if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
            refused = self.scheduler.add(Request(add.req_id, add.prompt_token_ids, add.sampling,
                                                 add.output_token_ids))
            self.num_requests += refused is None
            return refused
        except ValueError as e:
            log.warning("request refused", req_id=add.req_id, error=str(e))
            return RequestUpdate(add.req_id, finish_reason=FinishReason.ERROR, error=str(e))

    def abort_requests(self, req_ids: list[str]) -> list[RequestUpdate]:
        return self.scheduler.abort(req_ids)

    def has_work(self) -> bool:
        return bool(self.inflight) or self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def drain(self) -> None:
        """Finish what runs and start nothing new (a restart by hand is coming)."""
        self.scheduler.admitting = False

    @property
    def draining(self) -> bool:
        return not self.scheduler.admitting

    def is_drained(self) -> bool:
        """Draining, and nothing left running: what waits goes on after the restart."""
        return self.draining and not self.has_work()

    # the step

    def step(self) -> list[RequestUpdate]:
        """Schedule, execute, update: one step of continuous batching.

        Every group without a batch in flight gets one submitted; then the
        oldest batch's sampled tokens are taken. With one group (PP = 1) that
        is schedule -> execute -> update."""
        updates = []
        busy = {group for group, _ in self.inflight}
        for _ in range(self.num_groups):
            group, self.next_group = self.next_group, (self.next_group + 1) % self.num_groups
            if group in busy:
                continue
            scheduler_output = self.scheduler.schedule(group)
            if scheduler_output.num_scheduled_tokens:
                self.executor.submit(scheduler_output)
                self.inflight.append((group, scheduler_output))
            else:  # nothing to run: close the step's books at once
                empty = ModelRunnerOutput(step_id=scheduler_output.step_id)
                updates += self.scheduler.update_from_output(scheduler_output, empty)
        structured = self.scheduler.structured
        if not self.inflight and structured is not None and structured.has_pending():
            structured.wait(0.01)  # nothing runs: rather than spin, give the compile a moment
        if self.inflight:
            _, scheduler_output = self.inflight.popleft()
            model_output = self.executor.wait(scheduler_output.step_id)
            self.num_steps += 1
            updates += self.scheduler.update_from_output(scheduler_output, model_output)
        return updates

    def dummy_step(self) -> None:
        """One forward of a one-token dummy batch on every worker, through the same ring as a real
        step (so a mixture-of-experts model would enter its collectives on every rank), touching
        no request and no KV block of the cache; it samples nothing. What an idle DP rank runs
        while another rank has work, with --dp-lockstep (vLLM's execute_dummy_batch).

        Only between steps: with nothing in flight (pipeline parallelism), since the group answers
        steps in submission order."""
        if self.inflight:
            raise RuntimeError("a dummy step cannot overtake batches in flight")
        step_id = -1 - self.num_dummy_steps  # real steps count up from 1: the ids never meet
        self.executor.submit(SchedulerOutput(step_id=step_id, dummy=True))
        self.executor.wait(step_id)
        self.num_dummy_steps += 1

    # losing and regaining the workers

    def lose_workers(self) -> list[RequestUpdate]:
        """The worker group is gone: every running request goes back to waiting, all KV is dropped."""
        self.executor = None
        self.inflight.clear()
        return self.scheduler.preempt_all()

    def regain_workers(self, executor: Executor) -> list[RequestUpdate]:
        """A new worker group is ready: size the cache to it and go on; requests that no
        longer fit finish with an error."""
        self.executor = executor
        self.scheduler.admitting = True  # a drain was for restarting the workers: it is done
        return self.scheduler.preempt_all(executor.num_blocks)

    def close(self) -> None:
        if self.scheduler.structured is not None:
            self.scheduler.structured.compiler.close()
        if self.executor is not None:
            self.executor.close()
