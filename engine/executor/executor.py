"""How an engine core runs a step: on a Worker in its own process, or on a worker group.

Both offer `num_blocks`, `submit(scheduler_output)`, `wait(step_id)` and
`close()`, so the engine core schedules the same way whichever runs the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from engine.wire.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from engine.worker.worker import WorkerConfig


class Executor(Protocol):
    num_blocks: int

    def submit(self, scheduler_output: SchedulerOutput) -> None: ...

    def wait(self, step_id: int) -> ModelRunnerOutput: ...

    def close(self) -> None: ...


class InprocExecutor:
    """TP = PP = 1 with the worker inside the engine core's process (in-process mode)."""

    def __init__(self, config: WorkerConfig):
        if config.world_size != 1:
            raise ValueError("the in-process executor runs one worker; TP x PP > 1 needs worker processes")
        from engine.worker.worker import Worker  # torch: only where the model runs (2-3 s of an engine core's start)

        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()
        self.num_blocks = self.worker.ready_report().num_blocks
        self.worker.initialize_cache(self.num_blocks)
        self.done: dict[int, ModelRunnerOutput] = {}

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.done[scheduler_output.step_id] = self.execute(scheduler_output)

    def wait(self, step_id: int) -> ModelRunnerOutput:
        return self.done.pop(step_id)

    def close(self) -> None:
        self.worker.shutdown()
