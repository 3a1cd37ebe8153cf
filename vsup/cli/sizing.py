"""What `plan` and `serve` both work out from their flags: the memory per worker, and MODEL apart from
what follows `--`."""

from __future__ import annotations

from vsup.errors import UsageError
from vsup.topology import ParallelConfig


def check_values(max_model_len: int | None, kv_cache_memory: str | None, gpu_memory_utilization: float
                 ) -> int | None:
    """The value checks of the sizing flags, the same for `plan` and `serve`, with or without a model and
    whatever the machine: a UsageError naming the flag, else the --kv-cache-memory in bytes (None: unset).
    (What needs the machine, its devices and ports and run dir, is checked by `serve` alone.)"""
    from vsup.sizes import parse_size

    if max_model_len is not None and max_model_len < 1:
        raise UsageError(f"--max-model-len must be at least 1 (got {max_model_len})")
    if not 0 < gpu_memory_utilization <= 1:  # (NaN too)
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1] (got {gpu_memory_utilization})")
    if kv_cache_memory is None:
        return None
    try:
        kv_bytes = parse_size(kv_cache_memory)
    except ValueError as e:
        raise UsageError(f"--kv-cache-memory: {e}") from None
    if kv_bytes < 1:
        raise UsageError(f"--kv-cache-memory must be more than 0 bytes (got {kv_cache_memory!r})")
    return kv_bytes


def model_memory(model: str, config: ParallelConfig, dtype: str, max_model_len: int | None,
                 kv_cache_memory: str | None, gpu_memory_utilization: float, engine: str = "vsup",
                 vllm_args: tuple[str, ...] = (), linear_dtype: str = "auto", kv_cache_dtype: str = "auto",
                 cpu_here: bool = True):
    """(shape, memory plan) for MODEL under `config`, or a UsageError that says what is missing from MODEL or
    does not fit. A stock vLLM runs more architectures than our engine: for it, any model whose shape reads
    like a Llama's. `vllm_args`: what follows `--` for it. `cpu_here`: whether our engine will run on this
    machine's CPU, so that --dtype auto's bfloat16 parts follow it (not for --k8s's pods: they size for
    float32, which any CPU runs)."""
    from vsup.devices import cpu_computes_bfloat16, gpu_memory_bytes
    from vsup.memory import memory_plan
    from vsup.model_dir import check_model_dir
    from vsup.model_shape import read_model_shape

    kv_bytes = check_values(max_model_len, kv_cache_memory, gpu_memory_utilization)
    shape = read_model_shape(model, strict=engine != "vllm")
    check_model_dir(model, shape, engine, vllm_args)
    shape.check_parallel(config.tensor_parallel_size, config.pipeline_parallel_size)
    cpu_bfloat16 = config.device == "cpu" and cpu_computes_bfloat16()
    if config.device == "cuda":
        device_bytes = gpu_memory_bytes()
    else:
        import psutil
        device_bytes = psutil.virtual_memory().total // max(1, config.devices_per_node)
    memory = memory_plan(shape, tp=config.tensor_parallel_size, pp=config.pipeline_parallel_size, dtype=dtype,
                         device=config.device, device_bytes=device_bytes, kv_cache_memory=kv_bytes,
                         gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                         linear_dtype=linear_dtype, cpu_bfloat16=cpu_bfloat16, kv_cache_dtype=kv_cache_dtype,
                         auto_bfloat16=cpu_bfloat16 and cpu_here and engine != "vllm")
    return shape, memory


def split_engine_args(model: str | None, extra: list[str], engine: str) -> tuple[str | None, tuple[str, ...]]:
    """(MODEL, what followed `--`): click gives the first word after `--` to MODEL when MODEL was not
    given (`vsup serve --engine vllm -- --enforce-eager`), and a flag is never a model directory."""
    if model is not None and model.startswith("-"):
        model, extra = None, [model, *extra]
    if extra and engine != "vllm":
        raise UsageError(f"unexpected arguments {' '.join(extra)}: only --engine vllm passes what follows -- on")
    return model, tuple(extra)
