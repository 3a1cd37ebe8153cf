"""Restart units (docs/ARCHITECTURE.md): what restarts together when one process dies. Pure.

A TP/PP group cannot re-admit one rank (its communicators die with any
member), so a worker's death restarts its whole worker group; an engine
core's death restarts the core and its group; the coordinator and each API
server restart alone.
"""

from __future__ import annotations

from vsup.topology import API_SERVER, ENGINE_CORE, WORKER, ProcessSpec


def unit_of(spec: ProcessSpec) -> str:
    """The unit a process's death restarts."""
    if spec.role == WORKER:
        return f"worker-group dp{spec.dp}"
    return spec.name  # engine-core dpN, api-server aN, coordinator


def members(unit: str, processes: list[ProcessSpec]) -> list[ProcessSpec]:
    """Every process that (re)starts with `unit`: an engine core brings its worker group along."""
    if unit.startswith("worker-group dp"):
        dp = int(unit.removeprefix("worker-group dp"))
        return [p for p in processes if p.role == WORKER and p.dp == dp]
    if unit.startswith(f"{ENGINE_CORE} dp"):
        dp = int(unit.removeprefix(f"{ENGINE_CORE} dp"))
        return [p for p in processes if p.dp == dp and p.role in (ENGINE_CORE, WORKER)]
    return [p for p in processes if p.name == unit]


def units(processes: list[ProcessSpec]) -> list[str]:
    """All units, each once, in plan order."""
    seen: dict[str, None] = {}
    for p in processes:
        seen.setdefault(unit_of(p), None)
    return list(seen)


def dp_ranks_serving(processes: list[ProcessSpec], failed_units: set[str]) -> list[int]:
    """DP ranks whose engine core and worker group are both still allowed to run."""
    ranks = sorted({p.dp for p in processes if p.role == ENGINE_CORE})
    return [r for r in ranks if f"{ENGINE_CORE} dp{r}" not in failed_units and f"worker-group dp{r}" not in failed_units]


def can_serve(processes: list[ProcessSpec], failed_units: set[str]) -> bool:
    """Whether at least one API server and one DP rank are left (in-process mode: the API server)."""
    has_api = any(p.role == API_SERVER and p.name not in failed_units for p in processes)
    has_core = any(p.role == ENGINE_CORE for p in processes)
    return has_api and (not has_core or bool(dp_ranks_serving(processes, failed_units)))
