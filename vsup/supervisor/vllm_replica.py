"""One replica's vLLM tree as the supervisor sees it: the `vllm serve` it started, the processes vLLM
started and the hook introduced, who each one is, and where the tree stands.

With `--replicas N` the supervisor holds N of these, each its own restart unit
(`vllm`, or `vllm r0`, `vllm r1`, ...), on its own Unix socket, with its own
/dev/shm list and TMPDIR (in its own dir).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from vsup import procfs
from vsup.exits import describe_exit
from vsup.supervisor.child import Child
from vsup.supervisor.units import UnitId
from vsup.topology import ENGINE_CORE, FRONT, WORKER, Plan, process_name
from vsup.vllm import names
from vsup.vllm.plan import RESOURCE_TRACKER, helper_name
from vsup.vllm.progress import Progress

BY_SIGTERM = describe_exit(-signal.SIGTERM)
REAP_LOG = "reaped.txt"  # in a tree's dir: "PID WAIT_STATUS" of each process its parent reaped (the hook's)


@dataclass
class Observed:
    """A process of the tree that vLLM started and the hook introduced."""

    pid: int
    ppid: int
    pidfd: int | None
    started_at: float = field(default_factory=time.time)
    name: str | None = None
    role: str | None = None
    ranks: dict = field(default_factory=dict)
    title: str | None = None
    alive: bool = True
    last_exit: str | None = None
    reaped_by_parent: bool = False  # its parent waited for it (the hook's REAP_LOG): it did not follow it out
    sent: str | None = None  # the signal vsup sent it (an incident's evidence)


@dataclass
class Tree:
    """One replica: its root (`vllm serve`), its unit's id, and what vsup knows of it now (where it stands
    in its lifecycle is the supervisor's: vllm_units.py)."""

    r: int | None  # None when it is the only one
    root: Child
    id: UnitId
    socket: str  # where its vLLM serves: the front's upstream, and where the supervisor asks /health and /metrics
    dir: Path  # its shm list and TMPDIR note
    plan: Plan
    node: int = 0  # the node this supervisor runs on (its part of a tree that spans nodes)
    procs: dict[int, Observed] = field(default_factory=dict)
    gen: int = 0  # the tree's number among every tree started (the front resumes on another one)
    progress: Progress | None = None
    started_at: float = field(default_factory=time.monotonic)
    first_death: Observed | Child | None = None  # a death seen, not yet attributed (ATTRIBUTION_DELAY_S)
    deferred: list = field(default_factory=list)  # the pids that ended meanwhile
    blame: tuple | None = None  # (name, role) of what took it down last
    cause: object = None  # the process (Observed or the root) whose end took it down last
    died_at: float | None = None  # when its first death was seen (monotonic): the front acts on it at once
    shm_noted: set = field(default_factory=set)
    by_role: dict = field(default_factory=dict)  # its restarts, by the role whose process died

    @property
    def alive(self) -> bool:
        return self.root.alive or any(p.alive for p in self.procs.values())

    def owns(self, pid: int | None) -> bool:
        return pid is not None and (pid == self.root.pid or pid in self.procs)

    def specs(self, role: str | None = None) -> list:
        return [p for p in self.plan.processes
                if p.r == self.r and p.node == self.node and p.role != FRONT and role in (None, p.role)]

    # who is who

    def resolve(self, proc: Observed) -> None:
        """Its vsup name and title, from its command line: re-read until vLLM has titled it for good (a
        spawned process starts as `python -c ...`, a worker is titled twice). On the supervisor's loop."""
        if proc.name and proc.title and (proc.title.startswith(names.TITLE_PREFIX) or proc.role == names.HELPER):
            return
        title = procfs.cmdline(proc.pid)
        if title is None:
            return
        proc.title = title
        role = self.role_by_title(proc, title)
        if role is not None:
            self.name(proc, role)

    def role_by_title(self, proc: Observed, title: str) -> names.Role | None:
        """What its title says it is (or, before vLLM titles a spawned process, its parent); None: nothing
        new."""
        role = names.role_of_title(title.split(" "))
        if role is not None and (role.settled or proc.name is None):
            return role
        if proc.name is None and names.started_by_multiprocessing(title):
            return self.by_parent(proc)
        return None

    def by_parent(self, proc: Observed) -> names.Role | None:
        """Before vLLM titles a spawned process, its parent may already say what it is: a child of an
        engine core is one of its workers; the one child of `vllm serve` that is not a helper is the
        engine core when the plan has no other. (A process that vLLM runs otherwise, such as its
        model-registry probe on a first start, is never guessed.)"""
        parent = self.procs.get(proc.ppid)
        if parent is not None and parent.role == ENGINE_CORE:
            return names.Role(WORKER, settled=False)
        if proc.ppid == self.root.pid and [p.role for p in self.specs() if p.role not in (
                WORKER, names.HELPER) and p.name != self.root.spec.name] == [ENGINE_CORE]:
            return names.Role(ENGINE_CORE, dp=0)
        return None

    def naming(self, role: names.Role) -> tuple[str, dict, str | None]:
        """(role, ranks, vsup name) of a process that `role` says it is; no name while it is a worker
        of a plan with several and its ranks are not known yet."""
        if role.role == names.HELPER:
            return names.HELPER, {}, helper_name(RESOURCE_TRACKER, self.r, self.node)
        if not role.settled:
            workers = self.specs(WORKER)
            if len(workers) != 1:
                return WORKER, {}, None
            role = names.Role(WORKER, dp=workers[0].dp, pp=workers[0].pp, tp=workers[0].tp)
        ranks = {k: getattr(role, k) for k in ("a", "dp", "pp", "tp") if getattr(role, k) is not None}
        return role.role, ranks, process_name(role.role, r=self.r, **ranks)

    def name(self, proc: Observed, role: names.Role) -> None:
        proc.role, ranks, name = self.naming(role)
        if name is not None:
            proc.ranks, proc.name = ranks, name

    def who(self, pid: int, prefix_name: str | None) -> dict:
        """The tags of a line written by `pid`, one of this tree's processes. On the log router's thread: it
        reads what the loop knows and stores nothing; a process not named yet is named as its title, or
        else vLLM's log prefix, says."""
        root = self.root.spec
        if pid == self.root.pid:
            return {"name": root.name, "role": root.role, "r": self.r, "a": root.a, "dp": None, "pp": None,
                    "tp": None, "pid": pid}
        proc = self.procs.get(pid)
        role, ranks, name = (proc.role, proc.ranks, proc.name) if proc is not None else (None, {}, None)
        if proc is not None and name is None:
            title = procfs.cmdline(pid)
            said = (self.role_by_title(proc, title) if title else None) or \
                (names.role_of_name(prefix_name) if prefix_name else None)
            if said is not None:
                role, ranks, name = self.naming(said)
        return {"name": name or role or f"pid {pid}", "role": role, "r": self.r, "a": ranks.get("a"),
                "dp": ranks.get("dp"), "pp": ranks.get("pp"), "tp": ranks.get("tp"), "pid": pid}

    def name_of(self, proc) -> str:
        return proc.spec.name if isinstance(proc, Child) else (proc.name or f"pid {proc.pid}")

    def parent_of(self, proc: Observed):
        return self.root if proc.ppid == self.root.pid else self.procs.get(proc.ppid)

    def running(self, proc) -> bool:
        """Alive, and not on its way out (procfs.ending)."""
        return (proc is not self.root or proc.popen.poll() is None) and not procfs.ending(proc.pid)

    def learn_reaped(self) -> None:
        """How each process that its parent waited for ended, and that its parent outlived it: the hook
        writes both to REAP_LOG, as the supervisor sees neither (vLLM's engine core reaps a killed
        worker within milliseconds)."""
        try:
            lines = (self.dir / REAP_LOG).read_text().splitlines()
        except OSError:
            return
        for line in lines:
            try:
                pid, status = map(int, line.split())
            except ValueError:
                continue
            proc = self.procs.get(pid)
            if proc is not None and proc.last_exit in (None, procfs.UNSEEN_EXIT):
                proc.last_exit = describe_exit(os.waitstatus_to_exitcode(status))
                proc.reaped_by_parent = True

    def first_to_die(self, proc):
        """The process whose end ended the tree, asked a moment after the first end was seen: one whose
        parent has ended too followed it out (PR_SET_PDEATHSIG), and one that its parent told to stop: the
        parent is. One that its parent reaped (learn_reaped) ended first, even if the parent is gone by now:
        vLLM's engine core reaps a killed worker within milliseconds and exits on its own 0.9-2.4 s later,
        which a loaded machine may see at once. (Whether the parent ran when the child's end was seen
        tells nothing: a killed parent's children die of PR_SET_PDEATHSIG while its threads still end.)
        vLLM's processes never end cleanly on their own; an engine core stops its workers before it
        exits, and sends SIGTERM to those still running after VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s,
        which a loaded machine passes); a worker's own SIGTERM handler turns a kill -TERM from anyone else
        into exit 0."""
        seen = set()
        while isinstance(proc, Observed) and proc.ppid not in seen:
            seen.add(proc.ppid)
            parent = self.parent_of(proc)
            if parent is None or parent is self.root and proc.last_exit == "exit 0":
                break
            told = proc.last_exit == "exit 0" or proc.last_exit == BY_SIGTERM and parent is not self.root
            outlived = proc.reaped_by_parent or self.running(parent)
            if not told and outlived:
                break
            if parent is not self.root and parent.last_exit is None:
                parent.last_exit = procfs.exit_status(parent.pid)
            proc = parent
        return proc
