"""The plan of a stock vLLM deployment, with the argv and environment `vsup serve` starts it with.

Finds the vllm executable and checks every flag against what the installed
version takes, before anything starts.
"""

from __future__ import annotations

import os

from vsup.errors import UsageError
from vsup.topology import WORKER, ParallelConfig, Plan
from vsup.vllm.args import ServeFlags, serve_argv, serve_env, unknown_flags
from vsup.vllm.help import find_vllm, serve_flags
from vsup.vllm.plan import vllm_plan


def vllm_deployment(config: ParallelConfig, flags: ServeFlags, vllm_bin: str | None, extra: tuple[str, ...],
                    api_key: str | None) -> Plan:
    from vsup.devices import cpu_shares

    binary = find_vllm(vllm_bin)
    cpu_workers = [p for p in vllm_plan(config).processes if p.role == WORKER and p.device == "cpu"]
    binds = cpu_shares(sorted(os.sched_getaffinity(0)), len(cpu_workers))
    env = serve_env(config, flags, binds, api_key)
    argv = serve_argv(binary, config, flags, extra)
    unknown = unknown_flags(argv[3:], serve_flags(binary, env))
    if unknown:
        raise UsageError(f"the vLLM at {binary} does not take {', '.join(unknown)}; check the flags after -- "
                         f"(`vllm serve --help=all` lists what it takes), or give another --vllm-bin")
    return vllm_plan(config, tuple(argv), env)


def probe_url(host: str, port: int) -> str:
    """Where the supervisor itself reaches the API server: a wildcard host is reached on loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
