"""vsup's flags as `vllm serve` flags and environment. Pure.

`vllm serve` gets vLLM's defaults: what the user gave (vsup's flags that vLLM takes
too, and everything after `--`), plus only what supervision needs (`added`: the
socket vsup's front reaches it on, `--shutdown-timeout` from --drain-timeout, the
name it answers to). `--kv-cache-memory` on the CPU is VLLM_CPU_KVCACHE_SPACE (in
whole GiB), `--cpu-reserve` its thread binding, and the API key travels in the
environment, never in argv.
"""

from __future__ import annotations

import math

from vsup.errors import UsageError
from vsup.serve_flags import ServeFlags
from vsup.topology import MAX_PROCESSES, ParallelConfig

GIB = 2**30



def check_supported(config: ParallelConfig, **flags) -> None:
    """Exit 2 for vsup options that --engine vllm does not map (`flags`: option -> whether it was given).
    Across nodes it takes --nnodes (with --node-rank, --master-addr/-port, --headless: vLLM's multiprocessing
    backend) and --cluster-secret, which authenticates what the nodes' supervisors tell each other."""
    given = [flag for flag, on in flags.items() if on and not (flag == "--cluster-secret" and config.nnodes > 1)]
    if config.dp_address or config.data_parallel_size_local is not None or config.data_parallel_start_rank is not None:
        given.insert(0, "--dp-address/--dp-size-local/--dp-start-rank (data parallel across nodes; span nodes "
                        "with --nnodes instead)")
    if not config.multiprocessing:
        given.append("--no-multiprocessing")
    if given:
        raise UsageError(f"{', '.join(given)} not supported with --engine vllm (vLLM's own process model); give "
                         f"vLLM's own flags after --, or use --engine vsup")


def check_nodes(config: ParallelConfig, probe_port: int | bool | None, replicas: int) -> None:
    """Exit 2 for a vLLM across nodes that vsup could not keep together: the nodes' supervisors tell each
    other on the head's --probe-port when their part of the group went (vsup/supervisor/group.py), and one
    tree spans the nodes."""
    if config.nnodes == 1:
        return
    if probe_port is None:
        raise UsageError("--engine vllm with --nnodes needs --probe-port PORT, the same on every node: there the "
                         "head's vsup hears from the others when their part of the group went (vLLM's own "
                         "nodes do not notice, its issue #32136)")
    if replicas > 1:
        raise UsageError(f"--replicas {replicas} with --nnodes: one vLLM tree spans the nodes; run more groups "
                         f"(vsup plan --k8s --groups N) for more of them")


def check_replicas(vllm: bool, replicas: int, config: ParallelConfig | None = None) -> None:
    """Exit 2 for a --replicas that cannot be (vsup's own engine keeps its requests without replicas), or that
    makes more processes than a plan may hold (each replica a tree of `config`'s shape)."""
    if replicas < 1:
        raise UsageError(f"--replicas must be at least 1 (got {replicas})")
    if replicas > 1 and not vllm:
        raise UsageError("--replicas is for --engine vllm; vsup's own engine keeps its requests across a death "
                         "without replicas (for more of it, give -dp)")
    if config is not None and replicas * config.process_count > MAX_PROCESSES:
        raise UsageError(f"--replicas {replicas:,} trees of {config.process_count:,} processes are more than the "
                         f"{MAX_PROCESSES:,} vsup plans for: check --replicas for a typo")


def replica_gpus(visible: str | None, replicas: int, per_tree: int) -> list[str]:
    """Each replica's CUDA_VISIBLE_DEVICES: the user's list as given (GPU indexes, or `GPU-`/`MIG-` UUIDs)
    split in turn among the replicas, or GPUs 0, 1, ... when none is set. Exit 2 when the list names no GPU
    the way CUDA reads one, does not divide among the replicas, or leaves a replica short."""
    if visible is None:
        return [",".join(map(str, range(r * per_tree, (r + 1) * per_tree))) for r in range(replicas)]
    gpus = [entry.strip() for entry in visible.split(",") if entry.strip()]
    wrong = next((g for g in gpus if not (g.isdigit() or g.startswith(("GPU-", "MIG-")))), None)
    if wrong is not None:
        raise UsageError(f"CUDA_VISIBLE_DEVICES={visible} has {wrong!r}, which is no GPU index nor GPU-/MIG- UUID: "
                         f"list the GPUs for the replicas, comma-separated")
    if len(gpus) % replicas or len(gpus) // replicas < per_tree:
        raise UsageError(f"CUDA_VISIBLE_DEVICES={visible} lists {len(gpus)} GPUs, which do not split into "
                         f"--replicas {replicas} shares of {per_tree}: list {replicas * per_tree} (or a multiple of "
                         f"{replicas} with at least {per_tree} each), or change --replicas")
    share = len(gpus) // replicas
    return [",".join(gpus[r * share:(r + 1) * share]) for r in range(replicas)]


def serve_argv(vllm_bin: str, config: ParallelConfig, flags: ServeFlags, extra: tuple[str, ...] = ()) -> list[str]:
    """`vllm serve MODEL ...` for these flags: what vsup adds (`added`), then the user's own vsup flags that
    vLLM takes too, each only where the user gave it (all else stays vLLM's default), then `extra` (what
    followed `--`), unchanged. Across nodes, vLLM's own --nnodes, --node-rank, --master-addr and
    --master-port; a --headless node serves nothing itself."""
    argv = [vllm_bin, "serve", flags.model,
            *(x for arg, _ in added(config, flags.served_model_name, flags.drain_timeout, flags.uds) for x in arg)]
    if config.headless:
        argv.append("--headless")
    elif not flags.uds:
        argv += ["--host", flags.host, "--port", str(flags.port)]
    if config.nnodes > 1:
        argv += ["--nnodes", str(config.nnodes), "--node-rank", str(config.node_rank),
                 "--master-addr", config.master_addr, "--master-port", str(config.master_port)]
    for size, flag in ((config.tensor_parallel_size, "--tensor-parallel-size"),
                       (config.pipeline_parallel_size, "--pipeline-parallel-size"),
                       (config.data_parallel_size, "--data-parallel-size")):
        if size > 1:
            argv += [flag, str(size)]
    if config.api_server_count is not None and not config.headless:
        argv += ["--api-server-count", str(config.api_server_count)]
    asked = {"--dtype": flags.dtype, "--max-num-seqs": flags.max_num_seqs, "--seed": flags.seed,
             "--max-model-len": flags.max_model_len, "--gpu-memory-utilization": flags.gpu_memory_utilization}
    argv += [x for flag, value in asked.items() if flag in flags.asked and value is not None for x in (flag, str(value))]
    if config.device == "cuda" and flags.kv_cache_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(flags.kv_cache_bytes)]  # (the CPU's is VLLM_CPU_KVCACHE_SPACE)
    return [*argv, *extra]


def added(config: ParallelConfig, served_model_name: str, drain_timeout: float,
          uds: str | None) -> list[tuple[tuple[str, ...], str]]:
    """The flags vsup gives `vllm serve` that the user did not, each with why: the name it answers to, and
    what supervision needs: where it serves (`uds`, behind vsup's front), how long it drains."""
    where = [(("--uds", uds), "vsup's front serves --host/--port and resumes streams; vLLM serves the front "
                              "alone")] if uds and not config.headless else []
    return [(("--served-model-name", served_model_name), "--served-model-name: the same name under both engines"),
            *where,
            (("--shutdown-timeout", str(math.ceil(drain_timeout))),
             "--drain-timeout: how long a stop lets running requests finish")]


def cpu_placement(allowed: list[int], workers: int, reserve: int | None = None) -> tuple[list[list[int]], list[int]]:
    """The cores of each of vLLM's CPU workers, and those kept for the rest (vsup's front, vLLM's API
    server and engine core): `reserve` cores, by default one when there are more cores than workers, as
    vLLM's own binding does, so that nothing else runs on a worker's cores between its steps."""
    from vsup.placement import check_reserve, split

    cores = sorted(allowed)
    if reserve is None:
        reserve = 1 if workers and len(cores) > workers else 0
    check_reserve(reserve, len(cores), workers)
    kept = cores[len(cores) - reserve:] if reserve else []
    return split(cores[:len(cores) - len(kept)], workers), kept


def serve_env(config: ParallelConfig, flags: ServeFlags, cpu_binds: list[list[int]], api_key: str | None,
              kept: int = 0, node: tuple[str, str] | None = None) -> dict:
    """The environment vLLM reads for what has no flag: the device, the CPU KV cache, thread binding,
    the API key; and no usage reports home. Across nodes, `node` is this node's (address, interface) toward
    the head, where vLLM and gloo would otherwise guess (from the hostname, or a route to the internet)."""
    local = flags.host in ("127.0.0.1", "localhost", "::1") and config.nnodes == 1
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "NO_COLOR": "1",
           "VLLM_HOST_IP": "127.0.0.1" if local else "", "PYTHONUNBUFFERED": "1"}
    if node is not None:
        env["VLLM_HOST_IP"], env["GLOO_SOCKET_IFNAME"] = node
    env = {k: v for k, v in env.items() if v}
    if api_key:
        env["VLLM_API_KEY"] = api_key
    if config.device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        if flags.kv_cache_bytes is not None:  # (else vLLM's own: --gpu-memory-utilization of the node's memory)
            env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib(flags.kv_cache_bytes))
        if cpu_binds and all(cpu_binds):  # (vLLM's own binding wants a NUMA node per worker past one)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, cores)) for cores in cpu_binds)
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(kept)  # the cores cpu_placement kept
    return env


def cpu_kv_cache_gib(size: int) -> int:
    """--kv-cache-memory in the whole GiB that VLLM_CPU_KVCACHE_SPACE takes."""
    if size < GIB or size % GIB:
        raise UsageError(f"--kv-cache-memory {size} bytes: with --engine vllm on the CPU the KV cache is set in "
                         f"whole GiB (vLLM's VLLM_CPU_KVCACHE_SPACE); use {max(1, math.ceil(size / GIB))}GiB")
    return size // GIB


def unknown_flags(argv: list[str], known: set[str]) -> list[str]:
    """The flags of `argv` that this vLLM's `serve --help=all` does not list (`--a.b=c` counts as `--a`)."""
    unknown = []
    for arg in argv:
        if arg.startswith("-") and len(arg) > 1 and not arg[1:].replace(".", "").isdigit():
            flag = arg.split("=", 1)[0]
            base = flag.split(".", 1)[0]
            if flag not in known and base not in known:
                unknown.append(flag)
    return unknown
