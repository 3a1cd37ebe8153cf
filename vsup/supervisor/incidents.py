"""Incidents: why a unit went down, as the evidence says, kept before its restart. Pure.

An incident is opened when a unit goes down unasked (a process's exit, /health failing, a hang), with
what the supervisor saw at that moment (the adapter's evidence: the process that went first, how it ended,
whether vsup sent its signal, the memory counters around it, each process's last lines) and closed once
the unit serves again (how long the restart took, and what the processes said after the death: vLLM's
"EngineCore encountered an issue", a group's loss). A unit that goes down within CONSEQUENCE_S of an
incident that is still open is a consequence of it, a line inside it, not an incident of its own: the
first death in the order the supervisor observed them is the cause (the adapters already put a worker's
exit before its core's). incident_store.py keeps them on disk.

`verdict` names the cause: killed by the kernel's OOM killer (the cgroup's or the machine's `oom_kill`
counter moved: no dmesg needed), by vsup, or by a signal from outside; a crash by its signal; an error
exit with the exception its last lines name; a hang.
"""

from __future__ import annotations

import re
import signal as signals
from dataclasses import dataclass, field

CAUSES = ("oom", "killed", "crash", "error", "exit", "hang", "health")  # `verdict`'s, in one word
CONSEQUENCE_S = 5.0
MAX_LINES = 20  # of each process's last lines, and of what followed the death
LEVELS = ("debug", "info", "warning", "error", "critical")  # (how a kept line begins)
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Interrupt|Exit|Fault)\w*)(?::\s*(.*))?$")


@dataclass(frozen=True)
class Memory:
    """A process's memory evidence: the kernel's OOM-kill counters (its cgroup's and the machine's) as last
    sampled before its end and read after it, its peak RSS (VmHWM, sampled while it lived) and the memory
    pressure (PSI `some avg10`) at the end; None where this kernel does not say."""

    cgroup: str | None = None
    cgroup_oom_kills: tuple[int | None, int | None] = (None, None)
    machine_oom_kills: tuple[int | None, int | None] = (None, None)
    peak_rss_bytes: int | None = None
    pressure_avg10: float | None = None


@dataclass(frozen=True)
class Death:
    """How the first process of the unit to go ended."""

    process: str
    pid: int | None
    returncode: int | None  # as Popen has it: negative for a signal; None when only `exit` is known
    exit: str  # as ps spells it: `exit 1`, `signal 9 (SIGKILL)`
    sent_by_vsup: str | None = None  # the signal vsup sent it, if it did (SIGTERM, SIGKILL)
    memory: Memory = field(default_factory=Memory)


def signal_of(returncode: int | None) -> int | None:
    """The signal that ended a process: a negative return code, or a shell's 128+N (an exit 137 is a
    SIGKILL that a shell in between reported)."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if 128 < returncode < 128 + 65:
        return returncode - 128
    return None


def signal_name(number: int) -> str:
    try:
        return signals.Signals(number).name
    except ValueError:
        return f"signal {number}"


def raised(lines: list[str]) -> str | None:
    """The exception that a traceback among `lines` (each `LEVEL text`, or the text alone) ended with
    (`RuntimeError: CUDA error ...`)."""
    for line in reversed(lines):
        level, _, text = line.partition(" ")
        match = _EXCEPTION.match((text if level in LEVELS else line).strip())
        if match:
            return f"{match[1]}: {match[2]}" if match[2] else match[1]
    return None


def oom_killed(memory: Memory) -> bool:
    """Whether the OOM killer killed something in the process's cgroup (or, where the cgroup does not say,
    on the machine) between the last sample before its end and the read after it."""
    before, after = memory.cgroup_oom_kills
    if before is not None and after is not None:
        return after > before
    before, after = memory.machine_oom_kills
    return before is not None and after is not None and after > before


def verdict(death: Death | None, why: str, last_lines: list[str]) -> tuple[str, str]:
    """(cause, verdict): the cause in one word (oom, killed, crash, error, exit, hang, health), and in words."""
    if death is None:
        return ("hang" if why.startswith("hung") else "health"), why
    number = signal_of(death.returncode)
    shell = death.returncode is not None and death.returncode > 0 and number is not None
    via = f" (exit {death.returncode}: 128+{number}, as a shell reports it)" if shell else ""
    if number == signals.SIGKILL:
        if oom_killed(death.memory):
            where = f"cgroup {death.memory.cgroup}" if death.memory.cgroup_oom_kills[1] is not None else "machine"
            return "oom", f"killed by the kernel's OOM killer (oom_kill of the {where}: " \
                f"{_moved(death.memory)}){via}"
        if death.sent_by_vsup == "SIGKILL":
            return "killed", f"killed by vsup (SIGKILL){via}"
        return "killed", f"killed by SIGKILL from outside vsup (not the OOM killer: its counters did not move){via}"
    if number is not None:
        name = signal_name(number)
        if death.sent_by_vsup == name:
            return "killed", f"ended by vsup's {name}{via}"
        what = {signals.SIGSEGV: "crashed: segmentation fault", signals.SIGABRT: "crashed: aborted",
                signals.SIGBUS: "crashed: bus error", signals.SIGFPE: "crashed: floating-point exception",
                signals.SIGILL: "crashed: illegal instruction"}.get(number)
        if what:
            return "crash", f"{what} ({name}){via}"
        return "killed", f"killed by {name} from outside vsup{via}"
    error = raised(last_lines)
    if death.returncode not in (None, 0):
        return "error", f"{death.exit}" + (f": {error}" if error else "")
    return "exit", f"{death.exit} unasked" + (f" (last error: {error})" if error else "")


def _moved(memory: Memory) -> str:
    before, after = memory.cgroup_oom_kills if memory.cgroup_oom_kills[1] is not None else memory.machine_oom_kills
    return f"{before} before, {after} after"


@dataclass
class Incident:
    """One incident: opened when its unit went down, closed when it serves again."""

    id: str
    at: str  # ISO time, UTC
    unit: str
    role: str | None
    cause: str
    verdict: str
    why: str  # what the lifecycle was told: the exit, or /health's or the hang's reason
    death: Death | None
    last_lines: dict[str, list[str]]  # process -> its last lines before the death
    survivors: list[dict]  # the unit's processes still running then: name, pid (what vsup then killed)
    opened_s: float  # monotonic, when opened (not written)
    consequences: list[str] = field(default_factory=list)
    restart_s: float | None = None
    gave_up: str | None = None  # vsup's reason, when this was the unit's last
    pids: dict = field(default_factory=dict)  # process -> its pid then (not written)
    others: dict = field(default_factory=dict)  # every process running then -> its pid (not written)
    since: float = 0.0  # when the unit last started, wall clock (not written)
    next_s: float | None = None  # when its unit's next death was seen, monotonic (not written)
    died_s: float = 0.0  # when its first death was seen, monotonic (not written)
    stacks: dict = field(default_factory=dict)  # process -> its Python stacks (py-spy), of those still running
    stacks_s: float | None = None  # what taking them cost
    nccl_dumps: list = field(default_factory=list)  # NCCL's flight recorder dumps since the unit started
    requests: list = field(default_factory=list)  # in flight then: id, tokens generated, what became of it

    def lines_came(self, last_lines: dict[str, list[str]]) -> None:
        """Each process's last lines as read now (a dead process's last words can still be in its pipe when
        the incident opens), and the verdict they make."""
        self.last_lines = {k: v[-MAX_LINES:] for k, v in last_lines.items()}
        culprit = self.last_lines.get(self.death.process, []) if self.death else []
        self.cause, self.verdict = verdict(self.death, self.why, culprit)

    def to_json(self) -> dict:
        death = None
        if self.death is not None:
            d = self.death
            death = {"process": d.process, "pid": d.pid, "exit": d.exit, "returncode": d.returncode,
                     "signal": signal_name(n) if (n := signal_of(d.returncode)) else None,
                     "sent_by_vsup": d.sent_by_vsup,
                     "memory": {"cgroup": d.memory.cgroup, "cgroup_oom_kills": list(d.memory.cgroup_oom_kills),
                                "machine_oom_kills": list(d.memory.machine_oom_kills),
                                "peak_rss_bytes": d.memory.peak_rss_bytes,
                                "pressure_avg10": d.memory.pressure_avg10}}
        return {"id": self.id, "at": self.at, "unit": self.unit, "role": self.role, "cause": self.cause,
                "verdict": self.verdict, "why": self.why, "death": death, "survivors": self.survivors,
                "last_lines": self.last_lines, "stacks": self.stacks, "stacks_s": self.stacks_s,
                "nccl_dumps": self.nccl_dumps, "requests": self.requests,
                "consequences": self.consequences, "restart_s": self.restart_s, "gave_up": self.gave_up}


def open_incident(id: str, at: str, now: float, unit: str, role: str | None, why: str, death: Death | None,
                  last_lines: dict[str, list[str]], survivors: list[dict]) -> Incident:
    incident = Incident(id, at, unit, role, "", "", why, death, {}, survivors, now)
    incident.lines_came(last_lines)
    return incident


def consequence_of(open_incidents: list[Incident], now: float) -> Incident | None:
    """The open incident that a unit going down at `now` follows from, if any: the latest opened within
    CONSEQUENCE_S."""
    recent = [i for i in open_incidents if i.restart_s is None and now - i.opened_s <= CONSEQUENCE_S]
    return max(recent, key=lambda i: i.opened_s) if recent else None
