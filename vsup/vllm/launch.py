"""The plan of a stock vLLM deployment, with the argv and environment `vsup serve` starts it with.

Finds the vllm executable and checks every flag against what the installed
version takes, before anything starts. vLLM listens on a Unix socket in the
run dir (addresses.vllm_socket) with a random API key; vsup's front holds the
public host and port. With --replicas N, N trees, each on its own socket, cores
(or GPUs: the user's CUDA_VISIBLE_DEVICES split among them) and none shared.
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass, replace

from vsup import addresses
from vsup.errors import UsageError
from vsup.topology import WORKER, ParallelConfig, Plan
from vsup.serve_flags import ServeFlags
from vsup.vllm.args import cpu_placement, replica_gpus, serve_argv, serve_env, unknown_flags
from vsup.vllm.help import find_vllm, serve_flags
from vsup.vllm.plan import vllm_plan

PRIVATE_HOST = "127.0.0.1"
UNIX_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path, less its NUL)


@dataclass(frozen=True)
class FrontFlags:
    """The flags of vsup's front (vsup/front); their defaults are `vsup serve`'s."""

    resume_timeout: float
    max_pending: int
    max_resumes: int


def vllm_deployment(config: ParallelConfig, flags: ServeFlags, vllm_bin: str | None, extra: tuple[str, ...],
                    api_key: str | None, front: FrontFlags, run_dir: str, replicas: int = 1,
                    cpu_reserve: int | None = None) -> Plan:
    """The plan of the deployment in `run_dir`: the front, and each replica's vLLM behind it."""
    binary = find_vllm(vllm_bin)
    workers = sum(p.role == WORKER and p.device == "cpu" and p.node == config.node_rank
                  for p in vllm_plan(config).processes)
    node = node_toward(config.master_addr, config.master_port) if config.nnodes > 1 else None
    binds, kept = [], []  # (vLLM's own binding: its workers' cores, one kept per worker for the rest)
    if cpu_reserve is not None or replicas > 1 or workers > numa_nodes():
        # asked; or replicas, which must not share cores; or more workers than NUMA nodes, where vLLM's own
        # binding refuses to start ("Not enough allowed NUMA nodes")
        binds, kept = cpu_placement(sorted(os.sched_getaffinity(0)), workers * replicas, cpu_reserve)
    upstream_key = secrets.token_urlsafe(24)
    if replicas > 1 and config.device == "cuda":  # each replica its share of the GPUs the user let vsup see
        gpus = replica_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), replicas,
                            config.data_parallel_size * config.workers_per_engine)
    trees, upstreams = [], []
    for r in range(replicas):
        private = replace(flags, host=PRIVATE_HOST, uds=addresses.vllm_socket(run_dir, r if replicas > 1 else None))
        if len(private.uds.encode()) > UNIX_PATH_MAX:
            raise UsageError(f"the run dir {run_dir} is too long a path for vLLM's Unix socket in it "
                             f"({len(private.uds.encode())} of at most {UNIX_PATH_MAX} bytes): set VSUP_HOME "
                             f"to a shorter directory")
        env = serve_env(config, private, binds[r * workers:(r + 1) * workers], upstream_key, len(kept), node)
        if replicas > 1 and config.device == "cpu":  # vLLM's auto binding would put every replica on core 0
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if replicas > 1 and config.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = gpus[r]
        argv = serve_argv(binary, config, private, extra)
        if r == 0:
            unknown = unknown_flags(argv[3:], serve_flags(binary, env))
            if unknown:
                raise UsageError(f"the vLLM at {binary} does not take {', '.join(unknown)}; check the flags after "
                                 f"-- (`vllm serve --help=all` lists what it takes), or give another --vllm-bin")
        trees.append((tuple(argv), env))
        upstreams.append(private.uds)
    if config.headless:  # (a node that serves nothing: no front)
        return vllm_plan(config, trees)
    front_argv = (sys.executable, "-m", "vsup.front", "--host", flags.host, "--port", str(flags.port),
                  *(x for url in upstreams for x in ("--upstream", url)),
                  "--resume-timeout", str(front.resume_timeout),
                  "--max-pending", str(front.max_pending), "--max-resumes", str(front.max_resumes),
                  "--drain-timeout", str(flags.drain_timeout),
                  *(("--cpus", ",".join(map(str, kept))) if kept else ()))
    front_env = {"VSUP_FRONT_UPSTREAM_KEY": upstream_key, **({"VSUP_API_KEY": api_key} if api_key else {})}
    return vllm_plan(config, trees, (front_argv, front_env))


def numa_nodes() -> int:
    """This node's NUMA nodes with a CPU that vsup may use (vLLM's own binding puts one CPU worker on each)."""
    from vsup.devices import this_machine

    return max(1, len(this_machine("cpu").numa))


def node_toward(host: str, port: int) -> tuple[str, str]:
    """This node's address toward the head at `host`, and its interface's name (what the kernel would route
    by; a UDP socket's connect sends nothing), each as the user's environment gives it if it does
    (VLLM_HOST_IP, GLOO_SOCKET_IFNAME)."""
    import socket

    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            address = probe.getsockname()[0]
    except OSError as e:
        raise UsageError(f"--master-addr {host}: this node has no route to it ({e.strerror or e}); give the "
                         f"head node's address as the other nodes reach it") from None
    interface = next((name for name, addresses in psutil.net_if_addrs().items()
                      if any(a.address == address for a in addresses)), "")
    return os.environ.get("VLLM_HOST_IP") or address, os.environ.get("GLOO_SOCKET_IFNAME") or interface
