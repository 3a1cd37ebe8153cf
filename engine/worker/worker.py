"""`Worker`: one device's share of the model, in whatever process holds it."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import structlog
import torch

from engine.distributed import ParallelGroups
from engine.model.attention import kv_cache_block_bytes
from engine.model.config import ModelConfig, eos_token_ids
from engine.model.loader import load_model
from engine.ops import cpu_extension
from engine.progress import ProgressReporter
from engine.wire.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.wire.worker_messages import WorkerReady
from engine.worker import heap
from engine.worker.model_runner import ModelRunner
from engine.worker.prefault import Prefault

log = structlog.get_logger("worker")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker needs: the model, its place in the group, its budget."""

    model: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    device: str = "cpu"
    dtype: str = "auto"
    linear_dtype: str | None = None  # bfloat16: a float32 model's linears compute in it (engine/ops/cpu_linear.py)
    kv_cache_dtype: str | None = None  # bfloat16: the KV cache stores K/V rounded to it (None: the model's dtype)
    kv_cache_bytes: int = 2**30
    block_size: int = 16
    dist_init_method: str | None = None  # tcp://host:port or file:///path, unique per deployment
    num_threads: int | None = None
    name: str = "worker"

    @property
    def rank(self) -> int:
        """Rank inside the worker group (stage-major, as engine.distributed numbers it)."""
        return self.pp_rank * self.tensor_parallel_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def resolve_dtype(dtype: str, device: str) -> str | None:
    """auto: the checkpoint's own dtype on CUDA, float32 on the CPU (as `vsup plan` assumes)."""
    if dtype == "auto":
        return None if device.startswith("cuda") else "float32"
    return dtype


class Worker:
    """Init the group, load the shard, size and allocate the KV cache, execute steps.

    Call in order: `init_device`, `load_model`, `ready_report` (how many blocks
    the budget holds), `initialize_cache(num_blocks)` with the group's
    minimum, then `execute` for every step.
    """

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.groups: ParallelGroups | None = None
        self.runner: ModelRunner | None = None
        self.load_seconds = 0.0
        self.prefault: Prefault | None = None  # a CPU cache's pages faulted in ahead (prefault.py)

    def init_device(self, epoch: str = "") -> None:
        """Join the worker group (TP x PP > 1) under `epoch`, the generation its core forms."""
        cfg = self.config
        if cfg.device == "cpu" and cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if cfg.world_size > 1 and not cfg.dist_init_method:
            raise ValueError("a worker group of more than one rank needs a dist_init_method")
        self.groups = ParallelGroups.init(cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.rank,
                                          cfg.dist_init_method or "", device=cfg.device, epoch=epoch)

    def load_model(self) -> None:
        start = time.monotonic()
        cfg = self.config
        model_config = ModelConfig.from_pretrained(cfg.model, dtype=resolve_dtype(cfg.dtype, cfg.device))
        with contextlib.closing(ProgressReporter("loading weights", log)) as progress:
            model = load_model(cfg.model, self.groups, config=model_config, progress=progress,
                               linear_dtype=cfg.linear_dtype)
        kv_dtype = getattr(torch, cfg.kv_cache_dtype) if cfg.kv_cache_dtype else None  # None: the model's
        self.runner = ModelRunner(model, self.groups, cfg.block_size, eos_token_ids(cfg.model), kv_dtype)
        if cfg.device == "cpu":
            cpu_extension.load()  # built on first use on this machine: here, not inside a step
        self.load_seconds = time.monotonic() - start
        dtype = str(model.dtype).removeprefix("torch.")
        log.info("model loaded", layers=f"{model.layer_range.start}-{model.layer_range.stop - 1}", dtype=dtype,
                 linear_dtype=cfg.linear_dtype or dtype, kv_cache_dtype=cfg.kv_cache_dtype or dtype,
                 weight_bytes=self.weight_bytes,
                 seconds=round(self.load_seconds, 2))

    @property
    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for p in self.runner.model.parameters():
            if id(p) not in seen:  # a tied head shares the embedding's tensor
                seen.add(id(p))
                total += p.numel() * p.element_size()
        for module in self.runner.model.modules():  # oneDNN-packed copies (engine/ops/cpu_linear.py)
            packed = getattr(module, "packed", None)
            total += 0 if packed is None else packed.numel() * packed.element_size()
        return total

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_cache_block_bytes(self.runner.model.config, self.groups, self.config.block_size,
                                    self.runner.kv_cache_dtype)

    def ready_report(self) -> WorkerReady:
        """What the engine core needs to size the group's cache: this worker's block count and memory."""
        import psutil

        cfg = self.config
        num_blocks = cfg.kv_cache_bytes // self.kv_bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-memory {cfg.kv_cache_bytes} bytes holds no block of "
                             f"{self.kv_bytes_per_block} bytes; raise it")
        return WorkerReady(name=cfg.name, pid=os.getpid(), dp=cfg.dp_rank, pp=cfg.pp_rank, tp=cfg.tp_rank,
                           device=cfg.device, num_blocks=num_blocks, block_size=cfg.block_size,
                           weight_bytes=self.weight_bytes, kv_bytes_per_block=self.kv_bytes_per_block,
                           rss_bytes=psutil.Process().memory_info().rss, load_seconds=round(self.load_seconds, 3))

    def initialize_cache(self, num_blocks: int) -> int:
        """Allocate `num_blocks` KV blocks on every layer of this stage; returns the bytes."""
        self._stop_prefault()
        nbytes = self.runner.allocate_cache(num_blocks)
        if self.config.device == "cpu":  # for the steps: what loading freed goes back, and no more after
            heap.keep_freed_memory()
            self.prefault = Prefault([t for pair in self.runner.kv_caches for t in pair]).start()
        log.info("kv cache allocated", num_blocks=num_blocks, kv_cache_bytes=nbytes)
        return nbytes

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step; the sampling rank (last stage, TP rank 0) returns the sampled tokens."""
        with self.prefault.paused() if self.prefault is not None else contextlib.nullcontext():
            return self.runner.execute(scheduler_output)

    def _stop_prefault(self) -> None:
        if self.prefault is not None:
            self.prefault.stop()
            self.prefault = None

    def shutdown(self) -> None:
        self._stop_prefault()
        if self.groups is not None:
            self.groups.destroy()
