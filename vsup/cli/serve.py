"""`vsup serve`: launch exactly the plan's processes, tag their lines, heal them, stop them in order."""

import os
import sys
from dataclasses import replace

import typer

from vsup.cli import options
from vsup.cli.parallel_flags import parallel_flags
from vsup.errors import Failure, UsageError
from vsup.topology import ParallelConfig, Plan
from vsup.topology import plan as make_plan

app = typer.Typer()


@app.command(context_settings={"allow_extra_args": True})
@parallel_flags
def serve(
    ctx: typer.Context,
    model: options.Model = None,
    config: options.Config = None,
    engine: options.EngineOpt = options.EngineKind.vsup,
    vllm_bin: options.VllmBin = None,
    parallel: ParallelConfig = ParallelConfig(),  # the parallel flags (parallel_flags.py)
    replicas: options.Replicas = 1,
    cluster_secret: options.ClusterSecret = None,
    dp_lockstep: options.DpLockstep = False,
    dtype: options.DTypeOpt = options.DType.auto,
    linear_dtype: options.LinearDTypeOpt = options.LinearDType.auto,
    kv_cache_dtype: options.KvCacheDTypeOpt = options.KvCacheDType.auto,
    max_model_len: options.MaxModelLen = None,
    kv_cache_memory: options.KvCacheMemory = None,
    max_grammar_bytes: options.MaxGrammarBytes = None,
    gpu_memory_utilization: options.GpuMemoryUtilization = 0.9,
    max_num_seqs: options.MaxNumSeqs = 256,
    seed: options.Seed = 0,
    cpu_reserve: options.CpuReserve = None,
    host: options.Host = "127.0.0.1",
    port: options.Port = 8000,
    probe_port: options.ProbePort = None,
    name: options.Name = "default",
    api_key: options.ApiKey = None,
    served_model_name: options.ServedModelName = None,
    restart_policy: options.RestartPolicyFlag = options.RestartPolicyOpt.on_failure,
    max_restarts: options.MaxRestarts = 5,
    restart_max_delay: options.RestartMaxDelay = 30.0,
    drain_timeout: options.DrainTimeout = 30.0,
    stop_timeout: options.StopTimeout = 10.0,
    startup_timeout: options.StartupTimeout = 600.0,
    health_timeout: options.HealthTimeout = 30.0,
    hang_timeout: options.HangTimeout = 120.0,
    resume_timeout: options.ResumeTimeout = None,
    max_pending: options.MaxPending = 256,
    max_resumes: options.MaxResumes = 2,
    log_format: options.LogFormatOpt = options.LogFormat.auto,
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
    from vsup.cli import crash
    from vsup.cli.plan import placement_of
    from vsup.cli.sizing import check_values, model_memory, split_engine_args
    from vsup.rundir import RunDir
    from vsup.serve_flags import ServeFlags, engine_args
    from vsup.supervisor.supervisor import Options

    model, extra = split_engine_args(model, ctx.args, engine.value)
    check_values(max_model_len, kv_cache_memory, gpu_memory_utilization)  # (plan's too: before anything else)
    vllm = engine == options.EngineKind.vllm
    check_cluster_secret(parallel, cluster_secret)
    policy = check_serve_values(port=port, probe_port=probe_port, max_num_seqs=max_num_seqs,
                                restart_policy=restart_policy, max_restarts=max_restarts,
                                restart_max_delay=restart_max_delay, max_pending=max_pending,
                                max_resumes=max_resumes, resume_timeout=resume_timeout)
    from vsup.vllm.args import check_replicas

    check_replicas(vllm, replicas, parallel)
    run_dir = RunDir(name)
    run_dir.check()  # before the default model's conversion, the first process this starts
    port_socket = None if parallel.headless else bind_port(host, port)
    probe_socket = None if probe_port is None else bind_port(host, probe_port, "--probe-port")
    model_dir = os.path.abspath(model) if model else default_model(log_format.value, parallel)
    _, memory = model_memory(model_dir, parallel, dtype.value, max_model_len, kv_cache_memory,
                             gpu_memory_utilization, engine.value, extra, linear_dtype.value, kv_cache_dtype.value)
    flags = ServeFlags(model=model_dir, served_model_name=served_model_name or os.path.basename(model_dir),
                       host=host, port=port, dtype=dtype.value, max_num_seqs=max_num_seqs, seed=seed,
                       drain_timeout=drain_timeout, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, max_grammar_bytes=max_grammar_bytes, asked=asked(ctx))
    run = Options(model=os.path.basename(model_dir), url=f"http://{host}:{port}", restart_policy=policy,
                  startup_timeout=startup_timeout, drain_timeout=drain_timeout, stop_timeout=stop_timeout,
                  port_socket=port_socket, probe_socket=probe_socket, head=head_of(parallel, port, probe_port),
                  head_timeout=health_timeout, hang_timeout=hang_timeout)
    if vllm:
        from vsup.supervisor.vllm_units import VllmOptions
        from vsup.vllm.args import check_nodes, check_supported
        from vsup.vllm.launch import FrontFlags, vllm_deployment

        resume_timeout = startup_timeout if resume_timeout is None else resume_timeout  # as long as a start may take
        check_supported(parallel, **{"--cluster-secret": bool(cluster_secret), "--dp-lockstep": dp_lockstep,
                                     "--max-grammar-bytes": max_grammar_bytes is not None,
                                     "--linear-dtype": linear_dtype != options.LinearDType.auto,
                                     "--kv-cache-dtype": kv_cache_dtype != options.KvCacheDType.auto})
        check_nodes(parallel, probe_port, replicas)
        if parallel.nnodes > 1:
            run.group_secret = cluster_secret
            if parallel.headless:
                run.url = f"the head node at {parallel.master}"
        kv_cache_bytes = memory.stages[0].kv_cache_bytes if kv_cache_memory else None  # else vLLM's own default
        the_plan = vllm_deployment(parallel, replace(flags, kv_cache_bytes=kv_cache_bytes), vllm_bin, extra, api_key,
                                   FrontFlags(resume_timeout, max_pending, max_resumes), str(run_dir.path), replicas,
                                   cpu_reserve)
        tree = VllmOptions(health_timeout=health_timeout, hang_timeout=hang_timeout)
    else:
        ours = replace(flags, dtype=memory.dtype, linear_dtype=memory.linear_dtype,
                       kv_cache_dtype=memory.kv_cache_dtype, kv_cache_bytes=memory.stages[0].kv_cache_bytes)
        args = engine_args(ours, multiprocessing=parallel.multiprocessing, dp_lockstep=dp_lockstep)
        the_plan = make_plan(parallel, python=sys.executable, engine_args=args, run_dir=str(run_dir.path),
                             deployment=name)
        run.placement = placement_of(the_plan, cpu_reserve)
        if parallel.headless:
            run.url = f"the head node at {parallel.dp_address or parallel.master}"
        secrets = {"VSUP_API_KEY": api_key, "VSUP_CLUSTER_SECRET": cluster_secret}  # the environment, never argv
        run.env = {k: v for k, v in secrets.items() if v}
        tree = None
    run_dir.create()
    crash.remember(run_dir)
    run_dir.lock()
    run_dir.empty_metrics()
    code, message = supervise(the_plan, run_dir, run, log_format.value, vllm=tree)
    if code:
        typer.echo(f"vsup serve: {message}", err=True)
    raise typer.Exit(code)


def asked(ctx: typer.Context) -> frozenset[str]:
    """The flags the user gave, on the command line, in a VSUP_* variable or in --config: what `vllm serve` is
    told (vsup/vllm/args.py); those left at their defaults stay vLLM's."""
    given = (param for param in ctx.command.params
             if (source := ctx.get_parameter_source(param.name)) is not None and source.name != "DEFAULT")
    return frozenset(opt for param in given for opt in param.opts if opt.startswith("--"))


def head_of(parallel: ParallelConfig, port: int, probe_port: int | None) -> tuple[str, int] | None:
    """Where a headless node's head listens while it lives (vsup/supervisor/head_watch.py): the head's host
    at --probe-port (every pod of a LeaderWorkerSet has it), else at --port, as every node is given the
    same flags. Not a port of the engine's own: a core takes a connection that drops there for a peer's
    death."""
    from vsup.addresses import split_host_port

    if not parallel.headless:
        return None
    host = split_host_port(parallel.dp_address)[0] if parallel.dp_address else parallel.master_addr
    return host, probe_port or port


def check_serve_values(*, port: int, max_num_seqs: int, restart_policy: options.RestartPolicyOpt, max_restarts: int,
                       restart_max_delay: float, max_pending: int, max_resumes: int, resume_timeout: float | None,
                       probe_port: int | None = None, **_):
    """The value checks of serve's own flags, which need nothing but the flags (`plan` runs them on the ones
    it keeps for serve); the RestartPolicy they make."""
    if not 1 <= port <= 65535:
        raise UsageError(f"--port must be between 1 and 65535 (got {port})")
    if probe_port is not None and (not 1 <= probe_port <= 65535 or probe_port == port):
        raise UsageError(f"--probe-port must be between 1 and 65535 and not --port (got {probe_port})")
    if max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs must be at least 1 (got {max_num_seqs})")
    if max_pending < 0 or max_resumes < 0 or (resume_timeout or 0) < 0:
        raise UsageError("--max-pending, --max-resumes and --resume-timeout cannot be negative")
    return restart_policy_of(restart_policy, max_restarts, restart_max_delay)


def check_cluster_secret(parallel: ParallelConfig, cluster_secret: str | None) -> None:
    """What serve asks before it opens a port to other nodes (plan, which opens none, does not)."""
    if (parallel.dp_address or parallel.master) and not cluster_secret:
        flag = "--dp-address" if parallel.dp_address else "--nnodes"
        raise UsageError(f"{flag} opens tcp ports to other nodes: give --cluster-secret (better: set "
                         f"VSUP_CLUSTER_SECRET), the same on every node, so that only they can join")


def restart_policy_of(policy: options.RestartPolicyOpt, max_restarts: int, max_delay: float):
    """The RestartPolicy of the restart flags, or a UsageError naming the flag."""
    from vsup.supervisor.restart_policy import RestartPolicy

    try:
        return RestartPolicy(policy.value, max_restarts=max_restarts, max_s=max_delay)
    except ValueError as e:
        raise UsageError(str(e)) from None


def supervise(the_plan: Plan, run_dir, run, log_format: str, vllm=None) -> tuple[int, str | None]:
    """Run the supervisor of the plan (`vllm`: its VllmOptions, for a stock vLLM's trees) until it stops;
    (exit code, message). `run`: the supervisor's Options."""
    from vsup.supervisor.log_router import Console, JsonlWriter, LogRouter
    from vsup.supervisor.supervisor import Supervisor

    console = Console(sys.stdout, log_format)
    console.width = max(len(p.name) for p in the_plan.processes)
    writer = JsonlWriter(run_dir.log_file)
    router = LogRouter([writer.write, console.write], flushes=[writer.flush])
    if vllm is None:
        from vsup.supervisor.engine_units import EngineUnits

        supervisor = Supervisor(run_dir, run, router, lambda sup: EngineUnits(sup, the_plan))
    else:
        from vsup.supervisor.vllm_units import VllmUnits

        supervisor = Supervisor(run_dir, run, router, lambda sup: VllmUnits(sup, the_plan, vllm))
    router.start()
    try:
        code = supervisor.run()
    finally:
        router.stop()
        writer.close()
        console.close()
    return code, supervisor.message


def bind_port(host: str, port: int, flag: str = "--port"):
    """The public port's socket (or `flag`'s), bound before anything starts (refused when another program
    holds it) and held by the supervisor; whatever serves the port listens on it (Options.port_socket)."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"{flag} {port} on --host {host} cannot be used ({e.strerror}); "
                         f"choose another {flag} or stop what holds it") from None
    except (TypeError, ValueError) as e:  # a name that cannot be encoded (UnicodeError is a ValueError)
        sock.close()
        raise UsageError(f"--host {host!r} is not an address ({e}); give an IP address or a host name") from None
    return sock


def default_model(log_format: str, parallel: ParallelConfig) -> str:
    """The default model's directory, converted on first use by the engine. Its log lines (JSON on stderr) are
    tagged `model` and printed as the supervisor's console prints every line, in `log_format`. The engine
    checks its cache (writable, room for the conversion) before converting, and says what failed as the last
    line of its stdout: exit 2 for what the user can change, 1 for the rest."""
    import subprocess

    from vsup.supervisor.log_format import tag_line
    from vsup.supervisor.log_router import Console

    proc = subprocess.Popen([sys.executable, "-m", "engine.model.default_model"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "VSUP_LOG_FORMAT": "json"})
    console = Console(sys.stdout, log_format)
    console.width = max(len(p.name) for p in make_plan(parallel).processes)  # as the tree's lines will be
    tag = {"name": "model", "role": "model", "pid": proc.pid}
    for line in proc.stderr:
        if line.strip():
            console.write([tag_line(line.rstrip("\n"), "stderr", tag)])
    said = (proc.stdout.read().strip().splitlines() or [""])[-1]
    code = proc.wait()
    console.close()
    if code == 2:
        raise UsageError(f"{said}; or give a MODEL directory")
    if code != 0 or not said:
        raise Failure(said if code == 1 and said else
                      f"the default model could not be prepared (exit {code}); give a MODEL directory")
    return said
