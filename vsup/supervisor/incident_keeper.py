"""The supervisor's incidents (incidents.py): sampled evidence while the processes live, an incident opened
when a unit goes down unasked (lifecycle's Record, before the rest of the unit is killed), closed when it
serves again, written to the run dir at each (incident_store.py). On the loop's thread.

While they live, every second: each process's peak RSS and the OOM-kill counters of its memory cgroup
and of the machine, so that a death's "before" is a sample from before it and its "after" is read
right after it. The supervisor also makes itself the OOM killer's last choice among its processes, so that it
picks a worker, whose death vsup heals, not the supervisor: its own `oom_score_adj` -500 where it may lower it
(CAP_SYS_RESOURCE), else each of its processes' +OOM_RAISE as it first sees it (raising needs no privilege).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from vsup import procfs
from vsup.exits import returncode_of
from vsup.supervisor import flight_recorder, incident_store, stacks
from vsup.supervisor.incidents import CAUSES, MAX_LINES, Death, Incident, Memory, consequence_of, open_incident

KEEP_S = 3.0  # how far back the counters' samples go: "before" is the lowest in that time
FORGET_S = 60.0  # what was sampled of a process is kept this long after it was last seen (its incident reads it)
OOM_SCORE_ADJ = -500
OOM_RAISE = 100
RESUMED_S = 3.0  # how long after a unit is up again its resumed requests are counted in


class MemoryWatch:
    def __init__(self, raise_oom: bool = False):
        self.raise_oom = raise_oom  # each new process's oom_score_adj to +OOM_RAISE (the supervisor could not lower its own)
        self.cgroups: dict[int, str | None] = {}  # pid -> its memory cgroup
        self.peaks: dict[int, int] = {}
        self.seen: dict[int, float] = {}  # pid -> when it was last sampled alive
        self.counts: dict[str, deque[tuple[float, int | None]]] = {}  # cgroup (or "machine") -> samples

    def sample(self, pids: list[int], now: float) -> None:
        for pid in pids:
            self.seen[pid] = now
            if pid not in self.cgroups:
                self.cgroups[pid] = procfs.memory_cgroup(pid)
                if self.raise_oom:
                    procfs.set_oom_score_adj(pid, OOM_RAISE)
            peak = procfs.peak_rss(pid)
            if peak is not None:
                self.peaks[pid] = max(peak, self.peaks.get(pid, 0))
        for key in {*filter(None, (self.cgroups.get(p) for p in pids)), "machine"}:
            samples = self.counts.setdefault(key, deque())
            samples.append((now, self._count(key)))
            while samples and now - samples[0][0] > KEEP_S:
                samples.popleft()
        for gone in [pid for pid, at in self.seen.items() if now - at > FORGET_S]:
            self.seen.pop(gone)
            self.cgroups.pop(gone, None)
            self.peaks.pop(gone, None)

    @staticmethod
    def _count(key: str) -> int | None:
        return procfs.machine_oom_kills() if key == "machine" else procfs.cgroup_oom_kills(key)

    def _before(self, key: str | None) -> int | None:
        values = [v for _, v in self.counts.get(key or "", ()) if v is not None]
        return min(values) if values else None

    def evidence(self, pid: int | None) -> Memory:
        cgroup = self.cgroups.get(pid) if pid else None
        return Memory(cgroup=cgroup,
                      cgroup_oom_kills=(self._before(cgroup), procfs.cgroup_oom_kills(cgroup) if cgroup else None),
                      machine_oom_kills=(self._before("machine"), procfs.machine_oom_kills()),
                      peak_rss_bytes=self.peaks.get(pid) if pid else None,
                      pressure_avg10=procfs.memory_pressure())


class IncidentKeeper:
    def __init__(self, run_dir: Path, tail, log, later, roles=()):
        """`tail(name)`: a process's last lines, each (monotonic time, pid, `LEVEL text`), the log router's;
        `log`: the supervisor's; `later(seconds, fn)`: run fn on the loop that much later; `roles`: the plan's, each
        counted from 0 for every cause (a counter that is born at 1 shows no increase)."""
        self.run_dir, self.tail, self.log, self.later = Path(run_dir), tail, log, later
        self.open: dict[str, Incident] = {}  # unit -> the incident it is down in (its own, or one it followed)
        self.memory = MemoryWatch(raise_oom=not procfs.set_oom_score_adj(os.getpid(), OOM_SCORE_ADJ))
        # "role/cause" -> incidents since this supervisor started (metrics)
        self.counts: dict[str, int] = {f"{role}/{cause}": 0 for role in roles for cause in CAUSES}
        self.last: dict[str, dict] = {}  # unit -> its last incident, in short (ps), from earlier runs' on
        self.latest: dict[str, Incident] = {}  # unit -> its last incident of this run
        for kept in reversed(incident_store.load_all(self.run_dir)):
            self.last[kept["unit"]] = _short(kept)

    def sample(self, pids: list[int]) -> None:
        self.memory.sample(pids, time.monotonic())

    def record(self, unit: str, role: str | None, why: str, death: tuple | None, members: list[dict],
               since: float = 0.0, requests: list[dict] = (), died_at: float | None = None,
               everyone: dict[str, int] | None = None) -> None:
        """Unit `unit` went down (`why`); `death`: (process, pid, exit, the signal vsup sent it or None, its peak
        RSS from wait4 or None) of the first of its processes to go, None for a hang or failing health;
        `members`: its processes (name, pid, alive); `since`: when the unit last started (wall clock);
        `requests`: those it held (id, tokens, what became of each), as the adapter knows them; `died_at`: when
        its first death was seen (monotonic), where that was before now; `everyone`: every process running
        now, by name (whose warnings and errors after the death are its consequences)."""
        now = time.monotonic()
        mine = self.open.get(unit)
        if unit in self.latest:  # (the requests resumed from here on are this death's, not the last one's)
            self.latest[unit].next_s = min(died_at or now, now)
        if mine is not None and mine.unit == unit and mine.restart_s is None:
            mine.consequences.append(f"its restart failed: {why}")  # (a new incident below)
            self._write(mine)
        lead = consequence_of([i for i in self.open.values() if i.unit != unit], now)
        if lead is not None:
            what = f"{death[0]} {death[2]}" if death else why
            lead.consequences.append(f"{unit} went down too ({what})")
            self.open[unit] = lead
            self._write(lead)
            return
        the_death = None
        if death is not None:
            process, pid, exit, sent, peak = death
            memory = self.memory.evidence(pid)
            if peak is not None:  # (wait4's, for a process vsup reaped: the true peak, however fast it grew)
                memory = replace(memory, peak_rss_bytes=max(peak, memory.peak_rss_bytes or 0))
            the_death = Death(process, pid, returncode_of(exit), exit, sent, memory)
        survivors = [{"process": m["process"], "pid": m["pid"]} for m in members
                     if m["alive"] and (death is None or m["process"] != death[0])]
        at = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        pids = {m["process"]: m["pid"] for m in members}
        incident = open_incident(incident_store.next_id(self.run_dir), at, now, unit, role, why, the_death,
                                 self._last_lines(pids), survivors)
        incident.pids, incident.since, incident.requests = pids, since, list(requests)
        incident.others = {**(everyone or {}), **pids}
        incident.died_s = min(died_at or now, now)
        # where each one still running stands, before vsup kills it: the survivors of a death, or every
        # process of a hung (or unhealthy) unit
        incident.stacks, incident.stacks_s = stacks.take({s["process"]: s["pid"] for s in survivors})
        self.open[unit] = self.latest[unit] = incident
        self._write(incident)
        key = f"{role or 'unknown'}/{incident.cause}"
        self.counts[key] = self.counts.get(key, 0) + 1
        self.later(1.0, lambda: self._refresh(incident))
        self.log("incident", "warning", id=incident.id, unit=unit, cause=incident.cause, verdict=incident.verdict)

    def up(self, unit: str, requests_after=lambda since, until: []) -> None:
        """Unit `unit` serves again: its own incident closes, with how long the restart took, the warnings and
        errors that the processes running at the death logged after it (its consequences), and the
        requests that `requests_after(since, until)` says were resumed or failed from its death on (until
        the unit's next incident), read again RESUMED_S on (the front resumes once the tree is up)."""
        incident = self.open.pop(unit, None)
        if incident is None or incident.unit != unit:
            return
        known = list(incident.requests)  # (what the adapter knew at the death)

        def resumed() -> list[dict]:
            return known + requests_after(incident.died_s, incident.next_s or float("inf"))
        incident.requests = resumed()
        self.later(RESUMED_S, lambda: (setattr(incident, "requests", resumed()), self._write(incident)))
        incident.restart_s = round(time.monotonic() - incident.opened_s, 1)
        incident.lines_came(self._last_lines(incident.pids))
        incident.nccl_dumps = flight_recorder.dumps(self.run_dir, incident.since)
        dead = incident.death.pid if incident.death else None
        after = [(t, f"{name}: {text}") for name, its_pid in incident.others.items() for t, pid, text in self.tail(name)
                 if t >= incident.died_s and pid == its_pid != dead and _error(text)]
        incident.consequences += [line for _, line in sorted(after)][:MAX_LINES]
        for other, held in list(self.open.items()):
            if held is incident:
                del self.open[other]
        self._write(incident)

    def _last_lines(self, pids: dict[str, int | None]) -> dict[str, list[str]]:
        """Each process's last lines, its own (by pid: a process of the same name started since is not it),
        however late its pipe was read."""
        found = {name: [text for _, p, text in self.tail(name) if p == pid][-MAX_LINES:] for name, pid in pids.items()}
        return {name: lines for name, lines in found.items() if lines}

    def _refresh(self, incident: Incident) -> None:
        """A second on: the lines that were still in the pipes of the dead process when it was opened."""
        if incident.restart_s is None:
            incident.lines_came(self._last_lines(incident.pids))
            incident.nccl_dumps = flight_recorder.dumps(self.run_dir, incident.since)
            self._write(incident)

    def gave_up(self, unit: str, reason: str) -> None:
        incident = self.open.get(unit)
        if incident is not None and incident.unit == unit:
            incident.gave_up = reason
            self._write(incident)

    def _write(self, incident: Incident) -> None:
        self.last[incident.unit] = _short(incident.to_json())
        try:
            incident_store.write(self.run_dir, incident.to_json())
        except OSError as e:
            self.log("could not write the incident", "error", id=incident.id, error=str(e))


def _short(incident: dict) -> dict:
    return {k: incident.get(k) for k in ("id", "at", "cause", "verdict", "restart_s", "gave_up")}


def _error(line: str) -> bool:
    return line.startswith(("warning ", "error ", "critical "))

