"""`vsup plan`: the process tree and count a deployment will have, before launch."""

from __future__ import annotations

import json

import typer

from vsup.cli import options as o

app = typer.Typer()


@app.command(context_settings={"allow_extra_args": True})
def plan(
    ctx: typer.Context,
    model: o.Model = None,
    config: o.Config = None,
    engine: o.EngineOpt = o.EngineKind.vsup,
    tensor_parallel_size: o.TensorParallelSize = 1,
    pipeline_parallel_size: o.PipelineParallelSize = 1,
    data_parallel_size: o.DataParallelSize = 1,
    api_server_count: o.ApiServerCount = None,
    replicas: o.Replicas = 1,
    dp_size_local: o.DpSizeLocal = None,
    dp_start_rank: o.DpStartRank = None,
    headless: o.Headless = False,
    dp_address: o.DpAddress = None,
    nnodes: o.Nnodes = 1,
    node_rank: o.NodeRank = 0,
    master_addr: o.MasterAddr = "127.0.0.1",
    master_port: o.MasterPort = 29500,
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
    With --engine vllm: the tree a stock `vllm serve` builds, by vLLM's rules (its helpers counted apart).
    """
    from vsup.cli.sizing import model_memory, parallel_config, split_engine_args
    from vsup.topology import plan as make_plan

    model, _ = split_engine_args(model, ctx.args, engine.value)

    config = parallel_config(
        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
        data_parallel_size=data_parallel_size, api_server_count=api_server_count, dp_size_local=dp_size_local,
        dp_start_rank=dp_start_rank, headless=headless, dp_address=dp_address, nnodes=nnodes, node_rank=node_rank,
        master_addr=master_addr, master_port=master_port, device=device.value, multiprocessing=multiprocessing)
    if replicas != 1 or engine == o.EngineKind.vllm:  # (vsup.vllm is no import of a plain `vsup plan`)
        from vsup.vllm.args import check_replicas

        check_replicas(engine == o.EngineKind.vllm, replicas)
    if engine == o.EngineKind.vllm:
        from vsup.vllm.args import check_supported
        from vsup.vllm.plan import vllm_plan

        check_supported(config)
        the_plan = vllm_plan(config, replicas=replicas)
    else:
        the_plan = make_plan(config)
    shape = memory = None
    if model is not None:
        shape, memory = model_memory(model, config, dtype.value, max_model_len, kv_cache_memory,
                                     gpu_memory_utilization, engine.value)

    if as_json:
        out = the_plan.to_json()
        if memory is not None:
            out["memory"] = memory_json(memory)
        typer.echo(json.dumps(out, indent=2))
    else:
        from vsup.printer import render_memory, render_plan
        typer.echo(render_plan(the_plan))
        if memory is not None:
            typer.echo(render_memory(shape, memory, max_model_len))


def memory_json(memory) -> dict:
    return {
        "dtype": memory.dtype,
        "workers": [{"pp": s.stage, "layers": [s.layers.start, s.layers.stop], "weight_bytes": s.weight_bytes,
                     "kv_bytes_per_token": s.kv_bytes_per_token, "kv_cache_bytes": s.kv_cache_bytes}
                    for s in memory.stages],
        "kv_bytes_per_token_per_dp_rank": memory.kv_bytes_per_token,
        "tokens_per_dp_rank": memory.tokens_per_dp_rank,
    }
