"""`vsup plan`: the process tree and count a deployment will have, before launch."""

from __future__ import annotations

import json
import os

import typer

from vsup.cli import options as o
from vsup.errors import UsageError

app = typer.Typer()


@app.command()
def plan(
    model: o.Model = None,
    tensor_parallel_size: o.TensorParallelSize = 1,
    pipeline_parallel_size: o.PipelineParallelSize = 1,
    data_parallel_size: o.DataParallelSize = 1,
    api_server_count: o.ApiServerCount = None,
    dp_size_local: o.DpSizeLocal = None,
    dp_start_rank: o.DpStartRank = None,
    headless: o.Headless = False,
    device: o.DeviceOpt = o.Device.auto,
    multiprocessing: o.Multiprocessing = True,
    dtype: o.DTypeOpt = o.DType.auto,
    max_model_len: o.MaxModelLen = None,
    kv_cache_memory: o.KvCacheMemory = None,
    gpu_memory_utilization: o.GpuMemoryUtilization = 0.9,
    as_json: o.Json = False,
) -> None:
    """Predict the process tree and its count before launch: the same list `vsup serve` starts.

    Count = API servers + DP engine cores + DP x TP x PP workers (+ 1 coordinator when DP > 1).
    """
    from vsup.devices import check_devices, resolve_device
    from vsup.topology import ParallelConfig, plan as make_plan

    config = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
        data_parallel_size=data_parallel_size, api_server_count=api_server_count,
        data_parallel_size_local=dp_size_local, data_parallel_start_rank=dp_start_rank,
        headless=headless, device=resolve_device(device.value), multiprocessing=multiprocessing)
    check_devices(config.device, config.devices_per_node)
    the_plan = make_plan(config)
    memory = None
    if model is not None:
        memory = _memory(model, config, dtype.value, max_model_len, kv_cache_memory, gpu_memory_utilization)

    if as_json:
        out = the_plan.to_json()
        if memory is not None:
            out["memory"] = memory
        typer.echo(json.dumps(out, indent=2))
    else:
        from vsup.printer import render_plan
        typer.echo(render_plan(the_plan))
        if memory is not None:
            typer.echo(memory["text"])


def _memory(model: str, config, dtype: str, max_model_len: int | None, kv_cache_memory: str | None,
            gpu_memory_utilization: float) -> dict:
    """Weights per worker, KV bytes per token and token capacity per DP rank for MODEL."""
    from vsup.devices import gpu_memory_bytes
    from vsup.memory import memory_plan, parse_size
    from vsup.model_shape import read_model_shape
    from vsup.printer import render_memory

    shape = read_model_shape(model)
    shape.check_parallel(config.tensor_parallel_size, config.pipeline_parallel_size)
    if max_model_len is not None and max_model_len < 1:
        raise UsageError(f"--max-model-len must be at least 1 (got {max_model_len})")
    kv_bytes = None
    if kv_cache_memory is not None:
        try:
            kv_bytes = parse_size(kv_cache_memory)
        except ValueError as e:
            raise UsageError(f"--kv-cache-memory: {e}") from None
    if config.device == "cuda":
        device_bytes = gpu_memory_bytes()
    else:
        import psutil
        device_bytes = psutil.virtual_memory().total // max(1, config.devices_per_node)
    mem = memory_plan(shape, tp=config.tensor_parallel_size, pp=config.pipeline_parallel_size, dtype=dtype,
                      device=config.device, device_bytes=device_bytes, kv_cache_memory=kv_bytes,
                      gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len)
    return {
        "dtype": mem.dtype,
        "workers": [{"pp": s.stage, "layers": [s.layers.start, s.layers.stop], "weight_bytes": s.weight_bytes,
                     "kv_bytes_per_token": s.kv_bytes_per_token, "kv_cache_bytes": s.kv_cache_bytes}
                    for s in mem.stages],
        "kv_bytes_per_token_per_dp_rank": mem.kv_bytes_per_token,
        "tokens_per_dp_rank": mem.tokens_per_dp_rank,
        "text": render_memory(shape, mem, max_model_len),
    }
