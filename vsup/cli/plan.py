"""`vsup plan`: the process tree and count a deployment will have, before launch."""

import os

import typer

from vsup.cli import options
from vsup.cli.parallel_flags import parallel_flags
from vsup.cli.serve import check_serve_values, serve
from vsup.cli.serve_options import with_serve_options
from vsup.topology import ParallelConfig

app = typer.Typer()


@app.command(context_settings={"allow_extra_args": True})
@with_serve_options(serve)
@parallel_flags(target=True)
def plan(
    ctx: typer.Context,
    model: options.Model = None,
    config: options.Config = None,
    engine: options.EngineOpt = options.EngineKind.vsup,
    parallel: ParallelConfig = ParallelConfig(),  # the parallel flags (parallel_flags.py)
    replicas: options.Replicas = 1,
    dtype: options.DTypeOpt = options.DType.auto,
    linear_dtype: options.LinearDTypeOpt = options.LinearDType.auto,
    kv_cache_dtype: options.KvCacheDTypeOpt = options.KvCacheDType.auto,
    max_model_len: options.MaxModelLen = None,
    kv_cache_memory: options.KvCacheMemory = None,
    gpu_memory_utilization: options.GpuMemoryUtilization = 0.9,
    cpu_reserve: options.CpuReserve = None,
    as_json: options.Json = False,
    k8s: options.K8s = False,
    image: options.Image = None,
    namespace: options.Namespace = "default",
    groups: options.Groups = 1,
    model_pvc: options.ModelPvc = None,
    model_host_path: options.ModelHostPath = None,
    pod_cpus: options.PodCpus = None,
    pod_memory: options.PodMemory = None,
    kept: dict | None = None,  # serve's own options (serve_options.py), checked as serve checks them
) -> None:
    """Predict the process tree and its count before launch: the same list `vsup serve` starts.

    Count = API servers + DP engine cores + DP x TP x PP workers (+ 1 coordinator when DP > 1).
    Each process's CPUs as `serve` would pin them on this machine (--cpu-reserve).
    With --engine vllm: the tree a stock `vllm serve` builds, by vLLM's rules (its helpers counted apart).
    It takes every option of `serve`; those that do not change the plan are checked as serve checks them.
    """
    from vsup.cli.sizing import check_values, model_memory, split_engine_args
    from vsup.topology import plan as make_plan

    model, extra = split_engine_args(model, ctx.args, engine.value)
    check_values(max_model_len, kv_cache_memory, gpu_memory_utilization)  # (serve's own, model or not)
    check_serve_values(**(kept or {}))

    config = parallel  # (checked, its device resolved)
    if replicas != 1 or engine == options.EngineKind.vllm:  # (vsup.vllm is no import of a plain `vsup plan`)
        from vsup.vllm.args import check_replicas

        check_replicas(engine == options.EngineKind.vllm, replicas, config)
    if engine == options.EngineKind.vllm:
        from vsup.vllm.args import check_nodes, check_supported
        from vsup.vllm.plan import vllm_plan

        check_supported(config, **{"--linear-dtype": linear_dtype != options.LinearDType.auto,
                                   "--kv-cache-dtype": kv_cache_dtype != options.KvCacheDType.auto})
        check_nodes(config, True if k8s else (kept or {}).get("probe_port"), replicas)  # (every pod has one)
        the_plan = vllm_plan(config, replicas=replicas)
        placement = None
    else:
        the_plan = make_plan(config)
        placement = placement_of(the_plan, cpu_reserve)
    shape = memory = None
    if model is not None and not (k8s and not os.path.isdir(model)):  # (--k8s: MODEL is the container's path)
        shape, memory = model_memory(model, config, dtype.value, max_model_len, kv_cache_memory,
                                     gpu_memory_utilization, engine.value, extra, linear_dtype.value,
                                     kv_cache_dtype.value, cpu_here=not k8s)

    if k8s:
        from vsup.cli.k8s import K8sFlags, manifests_yaml

        flags = K8sFlags(image, namespace, groups, model_pvc, model_host_path, pod_cpus, pod_memory)
        typer.echo(manifests_yaml(ctx, the_plan, memory, model, extra, flags), nl=False)
        return
    if as_json:
        out = the_plan.to_json()
        if memory is not None:
            out["memory"] = memory_json(memory)
        if engine == options.EngineKind.vllm:
            out["vllm_serve_adds"] = [{"args": list(args), "why": why}
                                      for args, why in vllm_added(config, model, kept or {}, replicas)]
        import json

        typer.echo(json.dumps(out, indent=2))
    else:
        from vsup.printer import render_memory, render_plan
        typer.echo(render_plan(the_plan, placement))
        if memory is not None:
            typer.echo(render_memory(shape, memory, max_model_len))
        if engine == options.EngineKind.vllm:
            typer.echo(render_added(vllm_added(config, model, kept or {}, replicas)))
    from vsup.devices import devices_short

    short = devices_short(config.device, config.devices_per_node)
    if short:  # a plan is for the target: only serve needs the devices
        typer.echo(f"note: {short}: `vsup serve` would refuse this plan here", err=True)


def vllm_added(config, model: str | None, kept: dict, replicas: int) -> list[tuple[tuple[str, ...], str]]:
    """The flags `vsup serve` would add to `vllm serve` (vsup/vllm/args.py), the run dir's socket as RUN_DIR."""
    from engine.model.config import DEFAULT_MODEL_NAME
    from vsup.addresses import vllm_socket
    from vsup.vllm.args import added

    name = kept.get("served_model_name") or os.path.basename(os.path.normpath(model or DEFAULT_MODEL_NAME))
    return added(config, name, kept.get("drain_timeout", 30.0), vllm_socket("RUN_DIR", 0 if replicas > 1 else None))


def render_added(adds: list[tuple[tuple[str, ...], str]]) -> str:
    """What vsup adds to `vllm serve`, one flag a line with why; all else is vLLM's default or the user's."""
    shown = [(" ".join(args), why) for args, why in adds]
    width = max(len(a) for a, _ in shown)
    return "\n".join(["", "vsup adds to `vllm serve` (the rest is vLLM's default, or yours):",
                      *(f"  {a:<{width}}  {why}" for a, why in shown)])


def placement_of(the_plan, cpu_reserve: int | None) -> dict:
    """Where each process of the plan runs on this machine, node by node (a remote node is taken to be
    like this one): vsup/placement.py."""
    from vsup.devices import this_machine
    from vsup.placement import place

    machine = this_machine(the_plan.config.device)
    return {name: where for node in the_plan.nodes()
            for name, where in place(the_plan.on_node(node), machine, cpu_reserve).items()}


def memory_json(memory) -> dict:
    return {
        "dtype": memory.dtype,
        "linear_dtype": memory.linear_dtype or memory.dtype,
        "kv_cache_dtype": memory.kv_cache_dtype or memory.dtype,
        "workers": [{"pp": s.stage, "layers": [s.layers.start, s.layers.stop], "weight_bytes": s.weight_bytes,
                     "kv_bytes_per_token": s.kv_bytes_per_token, "kv_cache_bytes": s.kv_cache_bytes}
                    for s in memory.stages],
        "kv_bytes_per_token_per_dp_rank": memory.kv_bytes_per_token,
        "tokens_per_dp_rank": memory.tokens_per_dp_rank,
    }
