"""Restart units (docs/ARCHITECTURE.md): what restarts together when one process dies. Pure.

A TP/PP group cannot re-admit one rank (its communicators die with any
member), so a worker's death restarts its whole worker group; an engine
core's death restarts the core and its group; the coordinator and each API
server restart alone. A stock vLLM tree is one unit, and vsup's front another.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from vsup.topology import API_SERVER, COORDINATOR, ENGINE_CORE, FRONT, WORKER, ProcessSpec, process_name


class UnitKind(StrEnum):
    WORKER_GROUP = "worker-group"  # the TP x PP workers of one DP rank
    ENGINE_CORE = "engine-core"    # a core, with its worker group
    API_SERVER = "api-server"      # one API server, alone
    COORDINATOR = "coordinator"    # the coordinator, alone
    FRONT = "front"                # vsup's front before the vLLM trees, alone
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
    def api_server(cls, name: str) -> UnitId:
        return cls(UnitKind.API_SERVER, name)

    @classmethod
    def coordinator(cls) -> UnitId:
        return cls(UnitKind.COORDINATOR, COORDINATOR)

    @classmethod
    def front(cls) -> UnitId:
        return cls(UnitKind.FRONT, FRONT)

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
    if spec.role == API_SERVER:
        return UnitId.api_server(spec.name)
    return UnitId.coordinator()


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


def can_serve(all_units: list[UnitId], failed: set[UnitId]) -> bool:
    """Whether what is left can still serve: a way in (an API server, or vsup's front) and a way to
    generate (a DP rank whose engine core and worker group both stand, or a vLLM tree). In-process mode has
    no engine core: its API server holds it. A headless node has no way in: any unit it loses ends it."""
    if not any(u.kind in (UnitKind.API_SERVER, UnitKind.FRONT) and u not in failed for u in all_units):
        return False
    trees = [u for u in all_units if u.kind == UnitKind.VLLM_TREE]
    ranks = sorted({u.dp for u in all_units if u.kind == UnitKind.ENGINE_CORE})
    if not trees and not ranks:
        return True
    return any(t not in failed for t in trees) or \
        any(UnitId.engine_core(r) not in failed and UnitId.worker_group(r) not in failed for r in ranks)
