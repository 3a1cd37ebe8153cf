"""`vsup plan --k8s`: the Target of vsup/k8s/manifests.py, from the plan and the flags as given.

The containers' `vsup serve` flags are the ones this `plan` was given that `serve` takes (from the
command line, `VSUP_*` variables or a --config file: each written out, never the file's path, which is
this machine's), minus what the pod sets itself (--host, --port, --probe-port, --log-format) and the
secrets, which come from the Secret `<name>-secrets` through the environment, never argv.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from pathlib import Path

import typer

from vsup.cli import options
from vsup.cli.parallel_flags import OPTIONS as PARALLEL_OPTIONS
from vsup.errors import UsageError
from vsup.k8s.manifests import MOUNT, PROBE_PORT, Target, dashboard_text, manifests, to_yaml
from vsup.topology import WORKER

SET_BY_THE_POD = {"host", "port", "probe_port", "log_format", "headless",
                  "config"}  # (a file of this machine: its values are written out one by one instead)
SECRETS = {"api_key": ("VSUP_API_KEY", "api-key"), "cluster_secret": ("VSUP_CLUSTER_SECRET", "cluster-secret")}
GRAFANA = Path(__file__).parents[1] / "grafana"
GIB = 1 << 30


@dataclass(frozen=True)
class K8sFlags:
    image: str | None
    namespace: str
    groups: int
    model_pvc: str | None
    model_host_path: str | None
    pod_cpus: str | None
    pod_memory: str | None


def manifests_yaml(ctx: typer.Context, the_plan, memory, model: str | None, extra: list[str], f: K8sFlags) -> str:
    from vsup.cli.serve import serve

    params = ctx.params
    name = _name(params.get("name") or "default")
    if f.groups < 1:
        raise UsageError(f"--groups must be at least 1 (got {f.groups})")
    if f.model_pvc and f.model_host_path:
        raise UsageError("--model-pvc and --model-host-path both mount /models: give one")
    if (f.model_pvc or f.model_host_path) and not (model or "").startswith(MOUNT + "/"):
        raise UsageError(f"MODEL is read inside the container, where the model is mounted at {MOUNT}: give "
                         f"MODEL as {MOUNT}/<its directory> (got {model or 'none: the default model'})")
    config = the_plan.config
    vllm = params.get("engine") == options.EngineKind.vllm.value
    nodes = len(the_plan.nodes())
    secrets = tuple(SECRETS[k] for k in SECRETS if params.get(k)) + \
        ((SECRETS["cluster_secret"],) if nodes > 1 and not params.get("cluster_secret") else ())
    port = params.get("port") or 8000
    serve_names = set(inspect.signature(serve).parameters) | set(PARALLEL_OPTIONS)
    argv = ["vsup", "serve", *([model] if model else []),
            *_flags(ctx, serve_names - SET_BY_THE_POD - set(SECRETS) - {"model", "ctx"}),
            "--host", "0.0.0.0", "--port", str(port), "--probe-port", str(PROBE_PORT), "--log-format", "json",
            *(["--", *extra] if extra else [])]
    on_leader = the_plan.on_node(0)
    workers = [p for p in on_leader if p.role == WORKER]
    drain, stop = params.get("drain_timeout") or 30.0, params.get("stop_timeout") or 10.0
    target = Target(
        name=name, namespace=f.namespace, image=f.image or f"vsup:{config.device}", groups=f.groups, nodes=nodes,
        serve=tuple(argv), port=port,
        gpus=config.devices_per_node * (params.get("replicas") or 1) if config.device == "cuda" else 0,
        cpus=f.pod_cpus or str(_cpus(config.device, len(workers), len(on_leader))),
        memory=f.pod_memory or f"{_memory_gib(config.device, memory, len(workers), len(on_leader))}Gi",
        shm=f"{max(1, math.ceil(len(on_leader) / 4))}Gi",
        grace_s=int(drain + 4 * stop + 5), startup_s=int(params.get("startup_timeout") or 600), secrets=secrets,
        model_pvc=f.model_pvc, model_host_path=f.model_host_path, ports=_group_ports(config),
        dashboards={p.name: dashboard_text(p.read_text())
                    for p in sorted(GRAFANA.glob("*.json")) if ("vllm" in p.name) == vllm})
    return to_yaml(manifests(target))


def _name(name: str) -> str:
    """The objects' name: `vsup-<--name>`, a DNS-1035 label (LWS's webhook and the Service want one)."""
    label = f"vsup-{name}"
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", label) or len(label) > 45:
        raise UsageError(f"--name {name!r} makes the Kubernetes name {label!r}, which is not a DNS-1035 label of "
                         f"at most 45 characters (lowercase letters, digits, '-'): choose another --name")
    return label


def _flags(ctx: typer.Context, names: set[str]) -> list[str]:
    """The flags of `names` whose value is not their default, as `vsup serve` takes them."""
    out = []
    for p in ctx.command.params:
        if p.name not in names or not p.opts or not p.opts[0].startswith("-"):
            continue
        value, default = ctx.params.get(p.name), getattr(p.default, "value", p.default)
        if value is None or value == default:
            continue
        long = next((o for o in p.opts if o.startswith("--")), p.opts[0])
        if getattr(p, "is_flag", False):
            if value:
                out.append(long)
            elif p.secondary_opts:
                out.append(p.secondary_opts[0])
            continue
        out += [long, str(getattr(value, "value", value))]
    return out


def _cpus(device: str, workers: int, processes: int) -> int:
    """A core per worker and one for the API servers, engine cores and coordinator on the CPU (as the
    default placement gives them); a core per process beside GPUs."""
    return workers + 1 if device == "cpu" else processes + 1


def _memory_gib(device: str, memory, workers: int, processes: int) -> int:
    """Memory per pod: on the CPU, each worker's weights and KV cache (the plan's), 1 GiB per other process
    and 1 GiB to spare; beside GPUs, the host memory that loading weights and the processes take."""
    others = processes - workers
    if memory is None:
        return 4 * workers + others + 1
    stage = max(memory.stages, key=lambda s: s.weight_bytes + s.kv_cache_bytes)
    if device == "cpu":
        return math.ceil(workers * (stage.weight_bytes + stage.kv_cache_bytes) / GIB) + others + 1
    return math.ceil(workers * stage.weight_bytes / GIB) + 2 * processes


def _group_ports(config) -> tuple[tuple[str, int], ...]:
    """The leader's port that the other pods of a group reach first (the rest follow it: addresses.py)."""
    from vsup.k8s.lws import DP_PORT

    if config.nnodes > 1:
        return (("master", config.master_port),)
    if config.dp_address:
        return (("dp", DP_PORT),)
    return ()
