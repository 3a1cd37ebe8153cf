"""Restart units (docs/ARCHITECTURE.md): what restarts together when one process dies. Pure.

A TP/PP group cannot re-admit one rank (its communicators die with any
member), so a worker's death restarts its whole worker group; an engine
core's death restarts the core and its group; the coordinator and each API
server restart alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from vsup.topology import API_SERVER, ENGINE_CORE, WORKER, ProcessSpec, process_name


class UnitKind(StrEnum):
    WORKER_GROUP = "worker-group"  # the TP x PP workers of one DP rank
    ENGINE_CORE = "engine-core"    # a core, with its worker group
    ALONE = "alone"                # one process: an API server, the coordinator, vsup's front
    VLLM_TREE = "vllm"             # one stock vLLM tree (a replica)


@dataclass(frozen=True)
class UnitId:
    """A restart unit; `name` is how logs, ps and state.json spell it."""

    kind: UnitKind
    name: str
    dp: int | None = None

    def __str__(self) -> str:
        return self.name

    @classmethod
    def worker_group(cls, dp: int) -> UnitId:
        return cls(UnitKind.WORKER_GROUP, f"worker-group dp{dp}", dp)

    @classmethod
    def engine_core(cls, dp: int) -> UnitId:
        return cls(UnitKind.ENGINE_CORE, process_name(ENGINE_CORE, dp=dp), dp)

    @classmethod
    def alone(cls, name: str) -> UnitId:
        return cls(UnitKind.ALONE, name)

    @classmethod
    def vllm_tree(cls, r: int | None) -> UnitId:
        """Replica `r`'s tree: `vllm`, or `vllm r1` when there are several."""
        return cls(UnitKind.VLLM_TREE, "vllm" if r is None else f"vllm r{r}")


def unit_of(spec: ProcessSpec) -> UnitId:
    """The unit a process's death restarts."""
    if spec.role == WORKER:
        return UnitId.worker_group(spec.dp)
    if spec.role == ENGINE_CORE:
        return UnitId.engine_core(spec.dp)
    return UnitId.alone(spec.name)  # api-server aN, coordinator


def members(unit: UnitId, processes: list[ProcessSpec]) -> list[ProcessSpec]:
    """Every process that (re)starts with `unit`: an engine core brings its worker group along."""
    if unit.kind == UnitKind.WORKER_GROUP:
        return [p for p in processes if p.role == WORKER and p.dp == unit.dp]
    if unit.kind == UnitKind.ENGINE_CORE:
        return [p for p in processes if p.dp == unit.dp and p.role in (ENGINE_CORE, WORKER)]
    return [p for p in processes if p.name == unit.name]


def units(processes: list[ProcessSpec]) -> list[UnitId]:
    """All units, each once, in plan order."""
    seen: dict[UnitId, None] = {}
    for p in processes:
        seen.setdefault(unit_of(p), None)
    return list(seen)


def dp_ranks_serving(processes: list[ProcessSpec], failed_units: set[UnitId]) -> list[int]:
    """DP ranks whose engine core and worker group are both still allowed to run."""
    ranks = sorted({p.dp for p in processes if p.role == ENGINE_CORE})
    return [r for r in ranks if not {UnitId.engine_core(r), UnitId.worker_group(r)} & failed_units]


def can_serve(processes: list[ProcessSpec], failed_units: set[UnitId]) -> bool:
    """Whether at least one API server and one DP rank are left (in-process mode: the API server)."""
    has_api = any(p.role == API_SERVER and UnitId.alone(p.name) not in failed_units for p in processes)
    has_core = any(p.role == ENGINE_CORE for p in processes)
    return has_api and (not has_core or bool(dp_ranks_serving(processes, failed_units)))
