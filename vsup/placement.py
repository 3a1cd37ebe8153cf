"""Where each process of a node runs: its CPUs, its threads and its priority. One pure function.

The seed splits tokenization from the step loop so that load on the API server cannot slow decoding.
On a CPU host that only holds when they do not fight over cores: as vLLM's CPU build does, `place`
keeps `reserve` cores for the API servers, engine cores and the coordinator, apart from the workers'
cores. With reserve 0 the workers get every core and the rest float over them (vsup's behaviour
before --cpu-reserve). On a GPU host the workers' work is on the GPU:
each process gets a core of its own where there are enough, the nearest to its GPU.

`vsup plan` prints what `place` returns, `vsup serve` applies it (each process sets it on itself at
start, engine/process.py), and `vsup ps` shows each live process's CPU set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vsup.cpulist import cpu_list
from vsup.errors import UsageError
from vsup.topology import API_SERVER, ENGINE_CORE, WORKER, ProcessSpec

# An API server that shares its CPUs with an engine core runs at this nice value: the core's step wins
# the CPU when both want it, and the API server still streams at once when the core sleeps (which it
# does for most of each step). Not where it shares with the workers (--cpu-reserve 0): their threads
# keep every core busy, and a niced API server then streams late (bench/api_server.py part b).
API_SERVER_NICE = 5


@dataclass(frozen=True)
class Machine:
    """The CPUs the supervisor may use, and where they and the GPUs sit."""

    cpus: tuple[int, ...]
    numa: tuple[tuple[int, ...], ...] = ()  # the CPUs of each NUMA node; () = one node
    gpu_numa: tuple[int, ...] = ()  # the NUMA node of each visible GPU (cuda:N); () = unknown

    def node_cpus(self, node: int) -> tuple[int, ...]:
        if node < len(self.numa):
            return tuple(c for c in self.numa[node] if c in self.cpus)
        return self.cpus


@dataclass(frozen=True)
class Placement:
    """One process's CPU set (() = not pinned: every CPU of the machine), its threads (a worker's torch
    threads, an API server's tokenizer threads) and its nice value; `exclusive`: no other process of
    the plan is given these CPUs."""

    cpus: tuple[int, ...] = ()
    threads: int = 1
    nice: int = 0
    exclusive: bool = False

    def describe(self) -> str:
        """`0-3`, `4 (shared)`, `4 (shared, nice 5)`, `any` (not pinned)."""
        notes = ([] if self.exclusive or not self.cpus else ["shared"]) + ([f"nice {self.nice}"] if self.nice else [])
        return (cpu_list(self.cpus) if self.cpus else "any") + (f" ({', '.join(notes)})" if notes else "")


def cpu_workers(processes: Sequence[ProcessSpec]) -> list[ProcessSpec]:
    """The processes that run the model on the CPU: the workers, or in-process mode's API server."""
    return [p for p in processes if p.device == "cpu"]


def default_reserve(processes: Sequence[ProcessSpec], machine: Machine) -> int:
    """--cpu-reserve's default: a core for each process beside the CPU workers (API servers, engine
    cores, the coordinator) as far as the cores go, leaving each CPU worker at least one; 0 without
    CPU workers (on a GPU host nothing needs keeping apart from the model's cores)."""
    workers = len(cpu_workers(processes))
    if not workers:
        return 0
    return max(0, min(len(processes) - workers, len(machine.cpus) - workers))


def check_reserve(reserve: int, cpus: int, workers: int) -> None:
    """Refuse a --cpu-reserve that leaves one of `workers` CPU workers without one of `cpus` cores."""
    if reserve < 0:
        raise UsageError(f"--cpu-reserve {reserve}: a number of cores, 0 or more")
    if workers and reserve and cpus - reserve < workers:
        raise UsageError(f"--cpu-reserve {reserve} leaves {max(0, cpus - reserve)} of this node's {cpus} CPUs to "
                         f"its {workers} CPU worker{'s' * (workers != 1)}; use at most --cpu-reserve "
                         f"{max(0, cpus - workers)}")


def place(processes: Sequence[ProcessSpec], machine: Machine, reserve: int | None = None) -> dict[str, Placement]:
    """Each process's placement by name; `reserve` None = the default. Deterministic: the same
    processes and machine give the same placement."""
    reserve = default_reserve(processes, machine) if reserve is None else reserve
    check_reserve(reserve, len(machine.cpus), len(cpu_workers(processes)))
    workers = cpu_workers(processes)
    others = [p for p in processes if p not in workers]
    if workers:
        return _cpu_host(workers, others, machine, reserve)
    return _gpu_host(others, machine)


def _cpu_host(workers: list[ProcessSpec], others: list[ProcessSpec], machine: Machine,
              reserve: int) -> dict[str, Placement]:
    cores = sorted(machine.cpus)
    kept, model = (cores[len(cores) - reserve:], cores[:len(cores) - reserve]) if reserve else ([], cores)
    shares = numa_split(model, len(workers), machine.numa) or split(model, len(workers))
    placed = {}
    for worker, share in zip(workers, shares):
        threads = len(share) or max(1, len(cores) // len(workers))  # unpinned: today's share of the threads
        placed[worker.name] = Placement(tuple(share), threads, exclusive=bool(share))
    return placed | _others(others, kept)


def _others(others: list[ProcessSpec], kept: list[int]) -> dict[str, Placement]:
    """API servers, engine cores and the coordinator on the kept cores: each on its own where there are
    enough, else all of them over all the kept cores (an API server's tokenizer threads as many), the
    API servers at API_SERVER_NICE so that an engine core's step wins the core they share."""
    if len(kept) >= len(others):
        return {p.name: Placement((core,), exclusive=True) for p, core in zip(others, kept)}
    shared = bool(kept) and any(p.role == ENGINE_CORE for p in others)
    return {p.name: Placement(tuple(kept), max(1, len(kept)), API_SERVER_NICE if shared else 0)
            if p.role == API_SERVER else Placement(tuple(kept)) for p in others}


def _gpu_host(processes: list[ProcessSpec], machine: Machine) -> dict[str, Placement]:
    """Every process on a core of its own, where there are enough, taken from the NUMA node of the
    GPU it works for (a worker's own GPU, an engine core's first worker's; API servers and the
    coordinator the first GPU's node), workers first, then engine cores, then API servers; without
    enough, not pinned."""
    if len(processes) > len(machine.cpus) or not processes:
        return {p.name: Placement() for p in processes}
    free = sorted(machine.cpus)
    gpu_of_dp = {}
    for p in processes:
        if p.role == WORKER and p.device:
            gpu_of_dp.setdefault(p.dp, p.device)
    placed = {}
    order = (WORKER, ENGINE_CORE, API_SERVER)  # who needs to be nearest first: the step loop before HTTP
    for p in sorted(processes, key=lambda p: (order.index(p.role) if p.role in order else len(order), p.name)):
        gpu = p.device or gpu_of_dp.get(p.dp) or "cuda:0"
        near = [c for c in machine.node_cpus(_numa_of(gpu, machine)) if c in free]
        core = (near or free)[0]
        free.remove(core)
        placed[p.name] = Placement((core,), exclusive=True)
    return {p.name: placed[p.name] for p in processes}


def _numa_of(device: str, machine: Machine) -> int:
    """The NUMA node of a `cuda:N` device (0 where unknown)."""
    index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
    return machine.gpu_numa[index] if index < len(machine.gpu_numa) else 0


def numa_split(cores: list[int], n: int, numa: tuple[tuple[int, ...], ...]) -> list[list[int]] | None:
    """`cores` for n workers without a share across two NUMA nodes: the workers in contiguous blocks
    over the nodes (a TP group stays on one node where it fits), each node's cores split among its
    own; None with one node, or where a node has fewer cores than workers."""
    nodes = [[c for c in cores if c in node] for node in numa]
    nodes = [node for node in nodes if node]
    if len(nodes) < 2 or n < len(nodes):
        return None
    counts = [sum(1 for i in range(n) if i * len(nodes) // n == k) for k in range(len(nodes))]
    if any(len(node) < count for node, count in zip(nodes, counts)):
        return None
    size = min(len(node) // count for node, count in zip(nodes, counts))  # every worker as many cores
    return [share for node, count in zip(nodes, counts) for share in split(node[:size * count], count)]


def split(cores: list[int], n: int) -> list[list[int]]:
    """`cores` in n equal runs, in order (the rest unused); [] for each when there are fewer cores than n."""
    share = len(cores) // n if n else 0
    if share < 1:
        return [[] for _ in range(n)]
    return [cores[i * share:(i + 1) * share] for i in range(n)]
