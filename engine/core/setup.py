"""How an engine core is put together, in its own process and in in-process mode alike.

Both read the same engine flags (`model`, `block_size`, `max_model_len`,
`max_num_seqs`, `max_num_batched_tokens`, `enable_prefix_caching`,
`pipeline_parallel_size`): the core's argv, or in-process mode's
InprocConfig, which spells them the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.core.engine_core import EngineCore
from engine.core.scheduler_config import SchedulerConfig
from engine.executor.executor import Executor
from engine.executor.worker_group import WorkerGroup
from engine.model.config import ModelConfig, eos_token_ids
from engine.args import DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES
from engine.structured.compiler import GrammarCompiler
from engine.structured.manager import StructuredOutputManager


def start_worker_group(address: str, world_size: int, timeout_s: float, on_wait: Callable[[], None] | None = None,
                       **options) -> WorkerGroup:
    """Bind the workers' socket, wait for all their READYs, have them allocate the cache, running
    `on_wait` every half second meanwhile; on any failure the group is closed (its workers are not
    told to stop: they may rejoin a new one)."""
    group = WorkerGroup(address, world_size, **options)
    try:
        group.wait_for_ready(timeout_s, on_wait)
        group.initialize_cache(on_wait=on_wait)
    except BaseException:
        group.close(shutdown_workers=False)
        raise
    return group


def build_engine_core(flags, executor: Executor, model_config: ModelConfig) -> EngineCore:
    """The scheduler's limits from the flags and the blocks the workers found room for, and the core
    on them; ValueError when the KV cache cannot hold one request of --max-model-len."""
    max_model_len = flags.max_model_len or model_config.max_model_len
    config = SchedulerConfig(
        num_blocks=executor.num_blocks, block_size=flags.block_size, max_model_len=max_model_len,
        max_num_seqs=flags.max_num_seqs, max_num_batched_tokens=max(flags.max_num_batched_tokens, flags.block_size),
        enable_prefix_caching=flags.enable_prefix_caching, eos_token_id=eos_token_ids(flags.model))
    capacity = config.num_blocks * config.block_size
    if capacity < max_model_len:
        raise ValueError(f"the KV cache holds {capacity} tokens but --max-model-len is {max_model_len}; "
                         f"raise --kv-cache-memory or lower --max-model-len")
    compiler = GrammarCompiler(flags.model, model_config.vocab_size, config.eos_token_ids,
                               timeout_s=getattr(flags, "grammar_compile_timeout", DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S),
                               max_bytes=getattr(flags, "max_grammar_bytes", DEFAULT_MAX_GRAMMAR_BYTES))
    return EngineCore(config, executor, model_config.vocab_size, num_batches_in_flight=flags.pipeline_parallel_size,
                      structured=StructuredOutputManager(compiler))
