"""The parallel flags that `plan` and `serve` share, written once and handed on as one object.

`@parallel_flags` puts the flags into a command's signature where it has a
`parallel: ParallelFlags` parameter (Typer reads `__signature__`), and calls
the command with them gathered into that one ParallelFlags.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields

from vsup.cli import options as o


@dataclass(frozen=True)
class ParallelFlags:
    """The shape of the deployment, and this node's part of it, as the command line gave them."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    api_server_count: int | None = None
    dp_size_local: int | None = None
    dp_start_rank: int | None = None
    headless: bool = False
    dp_address: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    device: str = "auto"
    multiprocessing: bool = True


OPTIONS = {  # each field's option, defined in options.py
    "tensor_parallel_size": o.TensorParallelSize, "pipeline_parallel_size": o.PipelineParallelSize,
    "data_parallel_size": o.DataParallelSize, "api_server_count": o.ApiServerCount, "dp_size_local": o.DpSizeLocal,
    "dp_start_rank": o.DpStartRank, "headless": o.Headless, "dp_address": o.DpAddress, "nnodes": o.Nnodes,
    "node_rank": o.NodeRank, "master_addr": o.MasterAddr, "master_port": o.MasterPort, "device": o.DeviceOpt,
    "multiprocessing": o.Multiprocessing,
}
DEFAULTS = {"device": o.Device.auto}  # (the option's type is the enum)


def parallel_flags(command):
    """Give `command` the parallel flags in place of its `parallel` parameter."""
    signature = inspect.signature(command, eval_str=True)
    flags = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=OPTIONS[f.name],
                               default=DEFAULTS.get(f.name, f.default)) for f in fields(ParallelFlags)]
    params = []  # all keyword-only, as Typer passes them
    for p in signature.parameters.values():
        params += flags if p.name == "parallel" else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)]

    @functools.wraps(command)
    def with_flags(*args, **kwargs):
        given = {name: kwargs.pop(name) for name in OPTIONS}
        given["device"] = getattr(given["device"], "value", given["device"])
        return command(*args, parallel=ParallelFlags(**given), **kwargs)

    with_flags.__signature__ = signature.replace(parameters=params)
    with_flags.__annotations__ = {p.name: p.annotation for p in params}
    return with_flags
