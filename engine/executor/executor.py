"""How an engine core runs a step: on a Worker in its own process, or on a worker group.

Both offer `num_blocks`, `execute(scheduler_output)` and `close()`, so the
engine core schedules the same way whichever runs the model.
"""

from __future__ import annotations

from typing import Protocol

from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker import Worker, WorkerConfig


class Executor(Protocol):
    num_blocks: int

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def close(self) -> None: ...


class InprocExecutor:
    """TP = PP = 1 with the worker inside the engine core's process (in-process mode)."""

    def __init__(self, config: WorkerConfig):
        if config.world_size != 1:
            raise ValueError("the in-process executor runs one worker; TP x PP > 1 needs worker processes")
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()
        self.num_blocks = self.worker.ready_report().num_blocks
        self.worker.initialize_cache(self.num_blocks)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(scheduler_output)

    def close(self) -> None:
        self.worker.shutdown()
