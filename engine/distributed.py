"""The communication of one worker group: TP x PP ranks over torch.distributed.

A worker holds one ParallelGroups and hands it to the model; nothing here is
module-level state, so a test may hold several (a single-rank one needs no
torch.distributed at all). Global rank = pp_rank * tp_size + tp_rank.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist


def layer_range(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The contiguous layers of stage `pp_rank`; the first stages take the
    remainder. vsup's planner splits by the same rule, so keep them equal."""
    if not 0 <= pp_rank < pp_size <= num_layers:
        raise ValueError(f"cannot place stage {pp_rank} of {pp_size} over {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def interface_of(address: str, interfaces: dict[str, list[str]]) -> str | None:
    """The name of the interface that carries `address`, out of {name: [its addresses]}."""
    return next((name for name, addresses in interfaces.items() if address in addresses), None)


def gloo_interface(init_method: str) -> str | None:
    """The interface through which this host reaches a tcp:// rendezvous: where gloo must listen.

    Left alone, gloo listens on the address that the host's name resolves to, and tells the other
    ranks to connect there; where the name resolves to loopback (127.0.1.1 by default on Debian and
    Ubuntu), a rank on another node cannot, and the group never forms. The address the kernel sends
    from toward the master is one the others can reach (a UDP connect sends nothing). None for
    file:// or a host that does not resolve."""
    url = urlsplit(init_method)
    if url.scheme != "tcp" or not url.hostname:
        return None
    try:
        family, _, _, _, where = socket.getaddrinfo(url.hostname, url.port or 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(where)
            local = probe.getsockname()[0]
    except OSError:
        return None
    import psutil

    return interface_of(local, {name: [a.address for a in addrs] for name, addrs in psutil.net_if_addrs().items()})


@dataclass(frozen=True)
class IntermediateTensors:
    """What one pipeline stage hands the next: the hidden states and the
    residual stream, before the next layer's fused add-and-norm."""

    hidden: torch.Tensor
    residual: torch.Tensor


@dataclass
class ParallelGroups:
    """This rank's place in its worker group and the collectives it runs.

    With tp_size = pp_size = 1 (see `single`) every helper is a no-op and no
    process group exists.
    """

    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    device: torch.device = torch.device("cpu")
    tp_group: dist.ProcessGroup | None = None
    is_initialized: bool = False

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> ParallelGroups:
        """One rank, no communication (TP = PP = 1, or in-process mode)."""
        return cls(device=torch.device(device))

    @classmethod
    def init(cls, tp_size: int, pp_size: int, rank: int, init_method: str,
             device: str | torch.device = "cpu", timeout_s: float = 120.0, epoch: str = "") -> ParallelGroups:
        """Join the worker group at `init_method` (`tcp://host:port` or
        `file:///path`, unique per deployment so two never meet): gloo on CPU,
        nccl on CUDA. Blocks until all tp_size * pp_size ranks have joined, or
        raises after `timeout_s`, which also bounds every later collective.
        The ranks meet under `epoch` (their core's group generation): one that
        reaches the store of a lost generation's rank 0, still alive, waits there
        for its own generation instead of joining the dead group."""
        world_size = tp_size * pp_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {tp_size} x {pp_size} ranks")
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        groups = cls(tp_size=tp_size, pp_size=pp_size, tp_rank=rank % tp_size,
                     pp_rank=rank // tp_size, device=device)
        if world_size == 1:
            return groups
        if device.type != "cuda" and not os.environ.get(GLOO_IFNAME):  # an operator's choice wins
            interface = gloo_interface(init_method)
            if interface:
                os.environ[GLOO_IFNAME] = interface  # gloo reads only this
        timeout = timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", world_size=world_size, rank=rank,
                                store=dist.PrefixStore(f"vsup-epoch-{epoch}", store), timeout=timeout)
        groups.is_initialized = True
        if tp_size > 1:
            # every rank must create every stage's group, in the same order
            for stage in range(pp_size):
                ranks = [stage * tp_size + r for r in range(tp_size)]
                group = dist.group.WORLD if pp_size == 1 else dist.new_group(ranks)
                if stage == groups.pp_rank:
                    groups.tp_group = group
        return groups

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """TP rank 0 of the last stage: it gets the full logits and samples."""
        return self.is_last_stage and self.tp_rank == 0

    # tensor parallel

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over this rank's TP group, in place; returns it."""
        if self.tp_size > 1:
            dist.all_reduce(tensor, group=self.tp_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every TP rank's `tensor` along `dim`, on every rank."""
        if self.tp_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every TP rank's `tensor` along `dim` on TP rank 0;
        the other ranks get None."""
        if self.tp_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(tensor, parts, group=self.tp_group, group_dst=0)
        return torch.cat(parts, dim=dim) if parts is not None else None

    # pipeline parallel: TP rank r of stage s talks to TP rank r of s +- 1

    def send_intermediate(self, tensors: IntermediateTensors) -> None:
        """Send hidden states and residual to the same TP rank of the next stage."""
        if self.is_last_stage:
            raise RuntimeError("the last pipeline stage has no next stage to send to")
        # one message, not two: each gloo send costs about 1 ms whatever its size
        dist.send(torch.stack([tensors.hidden, tensors.residual]), dst=self.rank + self.tp_size)

    def recv_intermediate(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> IntermediateTensors:
        """Receive what the previous stage sent for a step of `num_tokens` tokens."""
        if self.is_first_stage:
            raise RuntimeError("the first pipeline stage has no previous stage to receive from")
        buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=self.device)
        dist.recv(buf, src=self.rank - self.tp_size)
        return IntermediateTensors(hidden=buf[0], residual=buf[1])

    def barrier(self) -> None:
        """Wait for every rank of the worker group."""
        if self.is_initialized:
            dist.barrier()

    def destroy(self) -> None:
        """Leave the worker group; safe to call twice."""
        if self.is_initialized:
            dist.destroy_process_group()
            self.is_initialized = False
            self.tp_group = None
