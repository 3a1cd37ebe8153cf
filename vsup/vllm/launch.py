"""The plan of a stock vLLM deployment, with the argv and environment `vsup serve` starts it with.

Finds the vllm executable and checks every flag against what the installed
version takes, before anything starts. vLLM listens on a private port of
127.0.0.1 with a random API key; vsup's front holds the public host and port.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from dataclasses import dataclass, replace

from vsup.errors import UsageError
from vsup.topology import WORKER, ParallelConfig, Plan
from vsup.vllm.args import ServeFlags, cpu_placement, serve_argv, serve_env, unknown_flags
from vsup.vllm.help import find_vllm, serve_flags
from vsup.vllm.plan import vllm_plan

PRIVATE_HOST = "127.0.0.1"


@dataclass(frozen=True)
class FrontFlags:
    """The flags of vsup's front (vsup/front); their defaults are `vsup serve`'s."""

    resume_timeout: float
    max_pending: int
    max_resumes: int


def vllm_deployment(config: ParallelConfig, flags: ServeFlags, vllm_bin: str | None, extra: tuple[str, ...],
                    api_key: str | None, front: FrontFlags) -> tuple[Plan, str]:
    """The plan, and the private URL where vLLM serves behind the front."""
    binary = find_vllm(vllm_bin)
    cpu_workers = [p for p in vllm_plan(config).processes if p.role == WORKER and p.device == "cpu"]
    binds, kept = cpu_placement(sorted(os.sched_getaffinity(0)), len(cpu_workers))
    private = replace(flags, host=PRIVATE_HOST, port=free_port(PRIVATE_HOST))
    upstream_key = secrets.token_urlsafe(24)
    env = serve_env(config, private, binds, upstream_key, len(kept))
    argv = serve_argv(binary, config, private, extra)
    unknown = unknown_flags(argv[3:], serve_flags(binary, env))
    if unknown:
        raise UsageError(f"the vLLM at {binary} does not take {', '.join(unknown)}; check the flags after -- "
                         f"(`vllm serve --help=all` lists what it takes), or give another --vllm-bin")
    upstream = f"http://{PRIVATE_HOST}:{private.port}"
    front_argv = (sys.executable, "-m", "vsup.front", "--host", flags.host, "--port", str(flags.port),
                  "--upstream", upstream, "--resume-timeout", str(front.resume_timeout),
                  "--max-pending", str(front.max_pending), "--max-resumes", str(front.max_resumes),
                  "--drain-timeout", str(flags.drain_timeout),
                  *(("--cpus", ",".join(map(str, kept))) if kept else ()))
    front_env = {"VSUP_FRONT_UPSTREAM_KEY": upstream_key, **({"VSUP_API_KEY": api_key} if api_key else {})}
    return vllm_plan(config, tuple(argv), env, (front_argv, front_env)), upstream


def free_port(host: str) -> int:
    """A port nobody listens on now, for vLLM behind the front (kept across the tree's restarts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
