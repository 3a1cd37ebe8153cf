"""The parallel flags that `plan` and `serve` share, written once and handed on as one ParallelConfig.

`@parallel_flags` puts the flags into a command's signature where it has a
`parallel: ParallelConfig` parameter (Typer reads `__signature__`), and calls
the command with the ParallelConfig they make: checked, its device resolved.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import fields

from vsup.cli import options
from vsup.errors import UsageError
from vsup.topology import ParallelConfig

OPTIONS = {  # each flag's parameter: its option in options.py, and the ParallelConfig field it sets
    "tensor_parallel_size": (options.TensorParallelSize, "tensor_parallel_size"),
    "pipeline_parallel_size": (options.PipelineParallelSize, "pipeline_parallel_size"),
    "data_parallel_size": (options.DataParallelSize, "data_parallel_size"),
    "api_server_count": (options.ApiServerCount, "api_server_count"),
    "dp_size_local": (options.DpSizeLocal, "data_parallel_size_local"),
    "dp_start_rank": (options.DpStartRank, "data_parallel_start_rank"),
    "headless": (options.Headless, "headless"),
    "dp_address": (options.DpAddress, "dp_address"),
    "nnodes": (options.Nnodes, "nnodes"),
    "node_rank": (options.NodeRank, "node_rank"),
    "master_addr": (options.MasterAddr, "master_addr"),
    "master_port": (options.MasterPort, "master_port"),
    "device": (options.DeviceOpt, "device"),
    "multiprocessing": (options.Multiprocessing, "multiprocessing"),
}


def parallel_config(values: dict, target: bool = False, leader: bool = False) -> ParallelConfig:
    """The ParallelConfig of these field values, its device resolved and, unless it is for a `target` other
    than this node (plan), checked on this node; in a pod of a LeaderWorkerSet, with the group's rank and
    addresses (vsup/k8s/lws.py); as a group's `leader` sees them (plan --k8s)."""
    import os

    from vsup.devices import check_devices, resolve_device
    from vsup.k8s.lws import from_lws, leader_of

    if leader and values["device"] == "auto":
        raise UsageError("--k8s plans for the cluster, not for this machine: give --device cuda or --device cpu")
    values = leader_of(values) if leader else from_lws(values, os.environ)
    config = ParallelConfig(**{**values, "device": resolve_device(values["device"])})
    if not target:
        check_devices(config.device, config.devices_per_node)
    return config


def parallel_flags(command=None, *, target: bool = False):
    """Give `command` the parallel flags in place of its `parallel` parameter (`@parallel_flags`, or
    `@parallel_flags(target=True)` for a plan of a machine that need not be this one)."""
    if command is None:
        return functools.partial(parallel_flags, target=target)
    defaults = {f.name: f.default for f in fields(ParallelConfig)} | {"device": options.Device.auto}
    flags = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=option, default=defaults[field])
             for name, (option, field) in OPTIONS.items()]
    signature = inspect.signature(command, eval_str=True)
    params = []  # all keyword-only, as Typer passes them
    for p in signature.parameters.values():
        params += flags if p.name == "parallel" else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)]

    @functools.wraps(command)
    def with_flags(*args, **kwargs):
        values = {field: kwargs.pop(name) for name, (_, field) in OPTIONS.items()}
        values["device"] = getattr(values["device"], "value", values["device"])
        leader = target and kwargs.get("k8s", False)  # plan --k8s: the group's leader pod
        return command(*args, parallel=parallel_config(values, target, leader), **kwargs)

    with_flags.__signature__ = signature.replace(parameters=params)
    with_flags.__annotations__ = {p.name: p.annotation for p in params}
    return with_flags
