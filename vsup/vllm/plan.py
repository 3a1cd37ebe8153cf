"""The process tree a stock `vllm serve` builds for the parallel flags, by vLLM's own rules. Pure.

- API servers: `--api-server-count`, default the DP size. With one, `vllm serve`
  itself is the API server; with more, it stays as their parent (a helper) and
  they are `VLLM::APIServer_<i>`.
- One engine core per DP rank: `VLLM::EngineCore`, or `VLLM::EngineCore_DP<r>` when DP > 1.
- Workers: TP x PP per engine core, `VLLM::Worker[_DP<r>][_PP<r>][_TP<r>]` (a suffix where
  that size is above 1). On the CPU a worker is its own process even at TP x PP = 1; on
  CUDA at TP x PP = 1 the "uni" executor runs the model inside the engine core.
- `VLLM::DPCoordinator` when DP > 1.
- Helpers, counted apart: multiprocessing's resource tracker (one for the tree).

Before them all, vsup's own `front` holds the public port (vsup/front), with vLLM
on a private one behind it.

The names are vsup's (`worker dp0 pp0 tp1`); vLLM's titles go in the title column.
"""

from __future__ import annotations

from dataclasses import replace

from vsup.topology import (API_SERVER, COORDINATOR, ENGINE_CORE, FRONT, ROLES, WORKER, ParallelConfig, Plan,
                           ProcessSpec, process_name, process_title)
from vsup.vllm.names import HELPER, TITLE_PREFIX

ROOT_TITLE = "vllm serve"
RESOURCE_TRACKER = "resource-tracker"


def worker_title(config: ParallelConfig, dp: int, pp: int, tp: int) -> str:
    suffix = "".join(f"_{kind}{rank}" for kind, rank, size in (
        ("DP", dp, config.data_parallel_size), ("PP", pp, config.pipeline_parallel_size),
        ("TP", tp, config.tensor_parallel_size)) if size > 1)
    return f"{TITLE_PREFIX}Worker{suffix}"


def vllm_plan(config: ParallelConfig, argv: tuple[str, ...] = (), env: dict[str, str] | None = None,
              front: tuple[tuple[str, ...], dict[str, str]] = ((), {})) -> Plan:
    """The front (its argv and env), then every process of the tree in start order: the first is the one
    vsup starts (`argv`, `env`), and vLLM starts the rest."""
    dp_size, workers = config.data_parallel_size, config.workers_per_engine
    api_servers = config.head_api_server_count
    in_core = config.device == "cuda" and workers == 1  # the uni executor: no worker process

    def spec(role: str, title: str, device: str | None = None, name: str | None = None, **ranks) -> ProcessSpec:
        return ProcessSpec(role=role, name=name or process_name(role, **ranks), title=title, node=0,
                           device=device, argv=(), **ranks)

    def device_of(dp: int, pp: int = 0, tp: int = 0) -> str:
        return "cpu" if config.device == "cpu" else f"cuda:{dp * workers + pp * config.tensor_parallel_size + tp}"

    if api_servers == 1:
        processes = [spec(API_SERVER, ROOT_TITLE, a=0)]
    else:
        processes = [spec(HELPER, ROOT_TITLE, name=f"{HELPER} vllm-serve")]
        processes += [spec(API_SERVER, f"{TITLE_PREFIX}APIServer_{a}", a=a) for a in range(api_servers)]
    processes[0] = replace(processes[0], argv=tuple(argv), env=dict(env or {}))
    processes.insert(0, ProcessSpec(role=FRONT, name=FRONT, title=process_title(FRONT), node=0, device=None,
                                    argv=tuple(front[0]), env=dict(front[1])))
    for dp in range(dp_size):
        title = f"{TITLE_PREFIX}EngineCore" + (f"_DP{dp}" if dp_size > 1 else "")
        processes.append(spec(ENGINE_CORE, title, device_of(dp) if in_core else None, dp=dp))
    if not in_core:
        processes += [spec(WORKER, worker_title(config, dp, pp, tp), device_of(dp, pp, tp), dp=dp, pp=pp, tp=tp)
                      for dp in range(dp_size) for pp in range(config.pipeline_parallel_size)
                      for tp in range(config.tensor_parallel_size)]
    if dp_size > 1:
        processes.append(spec(COORDINATOR, f"{TITLE_PREFIX}DPCoordinator"))
    processes.append(spec(HELPER, "multiprocessing.resource_tracker", name=f"{HELPER} {RESOURCE_TRACKER}"))
    return Plan(config, tuple(processes), roles=(FRONT, *ROLES, HELPER))


def tree_root(plan: Plan) -> ProcessSpec:
    """The process vsup starts of the vLLM tree (`vllm serve`): the first after the front."""
    return next(p for p in plan.processes if p.role != FRONT)
