"""CPU sets in the kernel's cpulist format (`0-3,8,10-11`), both ways. Pure; `vsup ps` imports it alone."""

from __future__ import annotations

from collections.abc import Sequence


def cpu_list(cpus: Sequence[int]) -> str:
    """`0-3,8,10-11`: the kernel's cpulist format."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def parse_cpu_list(text: str) -> list[int]:
    """The kernel's cpulist format (`0-3,8,10-11`) as CPU numbers."""
    cpus = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    return cpus
