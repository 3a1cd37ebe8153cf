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
- Across nodes (`--nnodes N`, vLLM's multiprocessing backend), the TP x PP ranks are split
  among the nodes in order: node 0 runs the API servers, the engine core and its share of
  the workers; every other node a `vllm serve --headless` of its own (a helper: it only
  starts that node's workers), its share of the workers and a resource tracker. A node's
  helpers carry the node's number (`helper node1 vllm-serve`).

Before them all, vsup's own `front` holds the public port (vsup/front), with vLLM
on a Unix socket behind it. With `--replicas N` there are N such trees behind the
one front, each on its own socket, and every name carries its replica (`worker r1 dp0 pp0 tp0`).

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


def vllm_plan(config: ParallelConfig, trees: list[tuple[tuple[str, ...], dict[str, str]]] | None = None,
              front: tuple[tuple[str, ...], dict[str, str]] = ((), {}), replicas: int = 1) -> Plan:
    """The front (its argv and env; none on a --headless node), then every process of each replica's tree
    in start order: the first of a tree on this node is the one vsup starts (that tree's argv and env in
    `trees`), and vLLM starts the rest."""
    trees = trees or [((), {})] * replicas
    processes = [] if config.headless else [ProcessSpec(role=FRONT, name=FRONT, title=process_title(FRONT), node=0,
                                                         device=None, argv=tuple(front[0]), env=dict(front[1]))]
    for r, (argv, env) in enumerate(trees):
        processes += replica_tree(config, argv, env, r if len(trees) > 1 else None)
    return Plan(config, tuple(processes), roles=(FRONT, *ROLES, HELPER))


def replica_tree(config: ParallelConfig, argv: tuple[str, ...], env: dict[str, str],
                 r: int | None) -> list[ProcessSpec]:
    """One `vllm serve` tree (replica `r`, None when it is the only one)."""
    dp_size, workers = config.data_parallel_size, config.workers_per_engine
    api_servers = config.head_api_server_count
    in_core = config.device == "cuda" and workers == 1  # the uni executor: no worker process
    first_device = (r or 0) * dp_size * workers
    per_node = config.workers_per_node

    def spec(role: str, title: str, device: str | None = None, name: str | None = None, node: int = 0,
             **ranks) -> ProcessSpec:
        return ProcessSpec(role=role, name=name or process_name(role, r=r, **ranks), title=title, node=node,
                           device=device, argv=(), r=r, **ranks)

    def device_of(dp: int, pp: int = 0, tp: int = 0) -> str:
        index = first_device + dp * workers + pp * config.tensor_parallel_size + tp
        return "cpu" if config.device == "cpu" else f"cuda:{index % per_node if config.nnodes > 1 else index}"

    def helper(what: str, title: str, node: int = 0) -> ProcessSpec:
        return spec(HELPER, title, name=helper_name(what, r, node), node=node)

    def worker(dp: int, pp: int, tp: int) -> ProcessSpec:
        node = (pp * config.tensor_parallel_size + tp) // per_node
        return spec(WORKER, worker_title(config, dp, pp, tp), device_of(dp, pp, tp), node=node, dp=dp, pp=pp, tp=tp)

    if config.nnodes > 1:
        return spanning_tree(config, argv, env, spec, helper, worker)
    if api_servers == 1:
        processes = [spec(API_SERVER, ROOT_TITLE, a=0)]
    else:
        processes = [helper("vllm-serve", ROOT_TITLE)]
        processes += [spec(API_SERVER, f"{TITLE_PREFIX}APIServer_{a}", a=a) for a in range(api_servers)]
    processes[0] = replace(processes[0], argv=tuple(argv), env=dict(env))
    for dp in range(dp_size):
        title = f"{TITLE_PREFIX}EngineCore" + (f"_DP{dp}" if dp_size > 1 else "")
        processes.append(spec(ENGINE_CORE, title, device_of(dp) if in_core else None, dp=dp))
    if not in_core:
        processes += [worker(dp, pp, tp) for dp in range(dp_size) for pp in range(config.pipeline_parallel_size)
                      for tp in range(config.tensor_parallel_size)]
    if dp_size > 1:
        processes.append(spec(COORDINATOR, f"{TITLE_PREFIX}DPCoordinator"))
    processes.append(helper(RESOURCE_TRACKER, "multiprocessing.resource_tracker"))
    return processes


def spanning_tree(config: ParallelConfig, argv: tuple[str, ...], env: dict[str, str], spec, helper,
                  worker) -> list[ProcessSpec]:
    """One TP x PP group across --nnodes nodes: the head's part (the API servers, the engine core, its
    workers) and each other node's (its `vllm serve --headless`, its workers), every node with its
    resource tracker; on a --headless node, only that node's part. The first process of this node's part
    is the one vsup starts. (`spec`, `helper`, `worker`: replica_tree's makers.)"""
    def part(node: int) -> list[ProcessSpec]:
        if node == 0:
            count = config.head_api_server_count
            first = [spec(API_SERVER, ROOT_TITLE if count == 1 else f"{TITLE_PREFIX}APIServer_{a}", a=a)
                     for a in range(count)]
            if count > 1:
                first.insert(0, helper("vllm-serve", ROOT_TITLE))
            first.append(spec(ENGINE_CORE, f"{TITLE_PREFIX}EngineCore", dp=0))
        else:
            first = [helper("vllm-serve", ROOT_TITLE, node)]
        workers = [w for w in (worker(0, pp, tp) for pp in range(config.pipeline_parallel_size)
                               for tp in range(config.tensor_parallel_size)) if w.node == node]
        return [*first, *workers, helper(RESOURCE_TRACKER, "multiprocessing.resource_tracker", node)]

    nodes = [config.node_rank] if config.headless else range(config.nnodes)
    processes = [p for node in nodes for p in part(node)]
    mine = next(i for i, p in enumerate(processes) if p.node == config.node_rank)
    processes[mine] = replace(processes[mine], argv=tuple(argv), env=dict(env))
    return processes


def helper_name(what: str, r: int | None = None, node: int = 0) -> str:
    """`helper resource-tracker`, `helper r1 vllm-serve`, `helper node1 vllm-serve`: a helper's name, after
    the roles' pattern (a node's number where the tree spans nodes and it is not the head's)."""
    return f"{process_name(HELPER, r=r)}{f' node{node}' if node else ''} {what}"


def tree_roots(plan: Plan) -> list[ProcessSpec]:
    """The process vsup starts of each replica's vLLM tree on this node (`vllm serve`): the first of each
    replica's part here."""
    node = plan.config.node_rank
    roots: dict[int | None, ProcessSpec] = {}
    for p in plan.processes:
        if p.role != FRONT and p.node == node:
            roots.setdefault(p.r, p)
    return list(roots.values())
