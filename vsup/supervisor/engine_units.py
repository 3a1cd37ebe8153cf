"""Our engine behind the supervisor: its plan's processes, flat under the supervisor, in restart units
(units.py). What is particular to it:

- a unit is ready once each of its processes said "ready" on stdout; a worker group's death is told to its
  engine core at once (notify.CoreNotifier), which keeps its queue and waits for the new group;
- `vsup restart` drains first: an engine core finishes what runs, then its unit gets SIGTERM; an API server
  finishes its own requests on SIGTERM, one API server at a time so that the others serve throughout;
- the stop goes API servers, coordinator, engine cores with their workers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import deque

from vsup import addresses, procfs
from vsup.supervisor import lifecycle as lc
from vsup.supervisor import flight_recorder, units
from vsup.supervisor.child import Child
from vsup.supervisor.lifecycle import How, Limits, Note, Phase
from vsup.supervisor.notify import CoreNotifier
from vsup.supervisor.states import ProcessState
from vsup.supervisor.units import UnitId, UnitKind
from vsup.topology import API_SERVER, ENGINE_CORE, WORKER, Plan, process_name
from vsup.vllm.progress import Progress

SILENT_S = 6.0  # an engine core reports its load every 2 s, from a thread of its own: silent this long, it is stopped


def placement_env(where, env: dict) -> dict:
    """What a child reads at start (engine/process.py) to place itself: its CPUs, threads and nice value;
    a user's OMP_NUM_THREADS wins over the threads."""
    return {"VSUP_THREADS": str(where.threads), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", str(where.threads)),
            **({"VSUP_CPUS": ",".join(map(str, where.cpus))} if where.cpus else {}),
            **({"VSUP_NICE": str(where.nice)} if where.nice else {})}


class EngineUnits:
    """The adapter of our engine (supervisor.py says what an adapter does)."""

    engine = "vsup"

    def __init__(self, sup, plan: Plan):
        self.sup, self.plan = sup, plan
        self.node = plan.nodes()[0]
        specs = list(plan.on_node(self.node))
        self.children = [Child(spec, units.unit_of(spec)) for spec in specs]
        self.members = {id: [c for c in self.children if c.spec in units.members(id, specs)]
                        for id in units.units(specs)}
        self.generation: dict[int, int] = {}
        self.notifier = CoreNotifier(sup.run_dir)
        self.loads: dict[str, dict] = {}  # process name -> its last load report (engine/load.py)
        self.progress: dict[int, Progress] = {}  # DP rank -> its engine core's steps since its rank was ready
        self.waiting: deque[UnitId] = deque()  # API servers to restart gracefully, one at a time
        sup.router.sinks.append(lambda records: self._pick(records))
        sup.router.on_load = lambda record: sup.loop.post(("load", record))

    def units(self) -> dict[UnitId, Limits]:
        o = self.sup.options
        return {id: Limits(o.restart_policy, o.drain_timeout, o.stop_timeout) for id in self.members}

    def formula(self) -> str:
        return self.plan.formula

    def remote(self) -> list[dict]:
        return [p.to_json() for p in self.plan.processes if p.node != self.node]

    def unit_extra(self, unit: UnitId) -> dict:
        return {}

    def evidence(self, unit: UnitId) -> dict:
        """For an incident: the unit's role, the first of its processes to end (name, pid, exit, the signal
        vsup sent it) when one did, and its processes."""
        members = self.members[unit]
        culprit = next((c for c in members if c.spec.name == self.sup.lives[unit].culprit), None)
        death = None if culprit is None else (culprit.spec.name, culprit.pid, culprit.last_exit, culprit.sent,
                                              culprit.peak_rss)
        return {"role": (culprit or members[0]).spec.role, "death": death, "requests": self.held(unit),
                "members": [{"process": c.spec.name, "pid": c.pid, "alive": c.alive} for c in members],
                "since": min((c.started_at for c in members if c.started_at), default=0.0)}

    def held(self, unit: UnitId) -> list[dict]:
        """The requests the rank of `unit` held as its engine core last reported them (id, tokens generated),
        and what becomes of each: a worker group's are kept by the core and recomputed on the next group, a
        core's are sent again by the API servers with the tokens already streamed."""
        if unit.kind not in (UnitKind.WORKER_GROUP, UnitKind.ENGINE_CORE):
            return []
        core = process_name(ENGINE_CORE, dp=unit.dp)
        fate = (f"kept by {core}, recomputed on the new worker group" if unit.kind == UnitKind.WORKER_GROUP else
                "sent again by the API servers to a core, with the tokens already streamed")
        return [{"id": rid, "tokens": tokens, "fate": fate} for rid, tokens in
                (self.loads.get(core) or {}).get("requests") or []]

    def requests_after(self, unit: UnitId, since: float, until: float) -> list[dict]:
        return []  # (what a rank held is known when it goes down: held())

    def live(self) -> dict[str, int]:
        """Every running process of this node, by name."""
        return {c.spec.name: c.pid for c in self.children if c.alive}

    def group_desk(self) -> None:
        return None  # (our engine's nodes meet in its own links: engine/cluster.py)

    def on_head(self, reply: dict) -> None:
        pass

    # starting

    def before_start(self) -> None:
        self.sup.loop.at(time.monotonic() + 1.0, self.watch_progress)

    def watch_progress(self) -> None:
        """Every second: a rank whose engine core has requests and has stepped none for --hang-timeout is hung
        (its load reports carry both). Its worker group restarts (the core keeps the requests), or the core's
        unit when the core itself has gone silent (a stopped process sends no report)."""
        now = time.monotonic()
        for core in (c for c in self.children if c.spec.role == ENGINE_CORE):
            dp = core.spec.dp
            rank = [u for u in self.members if u.dp == dp and u.kind in (UnitKind.ENGINE_CORE, UnitKind.WORKER_GROUP)]
            load = self.loads.get(core.spec.name)
            if any(self.sup.lives[u].phase != Phase.READY for u in rank) or not load or load.get("pid") != core.pid \
                    or "steps" not in load:
                self.progress.pop(dp, None)
                continue
            progress = self.progress.setdefault(dp, Progress(float("inf"), self.sup.options.hang_timeout, now))
            why = progress.update(now, True, (load.get("num_running", 0) + load.get("num_waiting", 0), load["steps"]))
            if why:
                silent_s = time.time() - load["received_at"]
                core_stuck = silent_s > SILENT_S
                unit = next(u for u in rank if u.kind == (UnitKind.ENGINE_CORE if core_stuck else UnitKind.WORKER_GROUP))
                self.progress.pop(dp)
                self.sup.post(unit, lc.Stalled(why.replace("no token", "no step") + (
                    f"; {core.spec.name} has said nothing for {silent_s:.0f} s" if core_stuck else "")))
        self.sup.loop.at(now + 1.0, self.watch_progress)

    def startup_timeout(self) -> float:
        return self.sup.options.startup_timeout

    def late(self, running_only: bool = False) -> list[str]:
        """The processes not ready yet (`running_only`: of those, the ones running, not a failed one's)."""
        return [c.spec.name for c in self.children if not c.ready and (c.alive or not running_only)]

    def spawn(self, unit: UnitId) -> None:
        """Start the unit's processes that are not running (a worker group's may be, started with its engine
        core's unit)."""
        for child in self.members[unit]:
            if child.alive:
                self.sup.post(unit, lc.Started(child.pid))
        children = [c for c in self.members[unit] if not c.alive]
        env = {**os.environ, **(self.sup.options.env or {}), "VSUP_SUPERVISOR_PID": str(os.getpid()),
               "VSUP_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
        env.update(flight_recorder.env(self.sup.run_dir.path, self.plan.config.device, env))
        for dp in {c.spec.dp for c in children if c.spec.role == WORKER}:
            self.generation[dp] = self.generation.get(dp, 0) + 1
        for child in children:
            spec = child.spec
            if spec.role == WORKER:
                child.extra_argv = ["--dist-init-method", addresses.dist_init_method(
                    str(self.sup.run_dir.path), spec.dp, self.generation[spec.dp], self.plan.config.master)]
            port = ()
            if spec.role == API_SERVER:
                child.extra_argv, port = self.port_args()
            where = (self.sup.options.placement or {}).get(spec.name)
            out, err = child.spawn({**env, **placement_env(where, env)} if where else env, pass_fds=port)
            if spec.role == ENGINE_CORE:
                self.notifier.connect(spec.dp)
            tag = {"name": spec.name, "role": spec.role, "a": spec.a, "dp": spec.dp, "pp": spec.pp, "tp": spec.tp,
                   "pid": child.pid}
            self.sup.router.add(out, "stdout", tag)
            self.sup.router.add(err, "stderr", tag)
            self.sup.loop.watch(child.pidfd, lambda c=child: self.exited(c))
            self.sup.log("started", process=spec.name, pid=child.pid)
            for owner in self.units_of(child):
                self.sup.post(owner, lc.Started(child.pid))

    def port_args(self) -> tuple[list[str], tuple[int, ...]]:
        """For a process that serves the public port: the argv naming the held socket, and its fd to pass
        (neither when none is held, or once the stop began)."""
        sock = self.sup.options.port_socket
        if sock is None or sock.fileno() < 0:
            return [], ()
        return ["--listen-fd", str(sock.fileno())], (sock.fileno(),)

    def units_of(self, child: Child) -> list[UnitId]:
        """Every unit that `child` belongs to: a worker is in its group's and in its engine core's."""
        return [id for id, members in self.members.items() if child in members]

    # what the processes say (the router's thread posts it; taken here on the loop's thread)

    def _pick(self, records: list[dict]) -> None:
        """On the router's thread: hand the READY and "drained" reports to the loop."""
        for record in records:
            if record.get("event") in ("ready", "drained") and record.get("stream") == "stdout":
                self.sup.loop.post((record["event"], record["name"]))

    def on_item(self, item) -> None:
        kind, what = item
        if kind == "load":
            self.loads[what["name"]] = {**what, "received_at": time.time()}
        elif kind == "ready":
            self.ready(what)
        elif kind == "drained":  # (only a draining unit of the core's rank takes it)
            for unit in self.members:
                if unit.kind in (UnitKind.ENGINE_CORE, UnitKind.WORKER_GROUP) and \
                        process_name(ENGINE_CORE, dp=unit.dp) == what:
                    self.sup.post(unit, lc.Drained())

    def ready(self, name: str) -> None:
        child = next((c for c in self.children if c.spec.name == name and c.alive), None)
        if child is None or child.ready:
            return
        child.ready = True
        self.sup.log("ready", process=name, pid=child.pid, seconds=round(time.time() - child.started_at, 1))
        for unit in self.units_of(child):
            if all(c.ready for c in self.members[unit]):
                self.sup.post(unit, lc.Ready())
        self.sup.save()

    # deaths

    def exited(self, child: Child) -> None:
        if child.pidfd is None or not child.ended():
            return  # seen already: a worker's exit handles its core's first, and both may be in one select
        if child.spec.role == WORKER:  # a worker follows its vanished core out: the core's exit is the cause
            core = next((c for c in self.children if c.spec.role == ENGINE_CORE and c.spec.dp == child.spec.dp), None)
            if core is not None and core.pidfd is not None and core.ended():
                self.exited(core)
        self.sup.loop.forget(child.pidfd)
        code = child.reap()
        owners = self.units_of(child)
        if self.sup.stopping:
            self.sup.log("process stopped", process=child.spec.name, pid=child.pid, exit=child.last_exit)
        unasked = not self.sup.stopping and all(self.sup.lives[u].phase in lc.LIVE for u in owners)
        if unasked:
            self.sup.log("process exited", "error", process=child.spec.name, pid=child.pid, exit=child.last_exit)
        pid, exit = child.pid, child.last_exit  # (a unit's restart below may start the child anew)
        for unit in owners:
            if unasked and unit == child.unit:
                self.sup.post(unit, lc.Exited(pid, child.spec.name, exit, failure=code != 0))
            else:
                self.sup.post(unit, lc.Reaped(pid))

    # actions

    def signal(self, unit: UnitId) -> None:
        for child in self.members[unit]:
            child.signal(signal.SIGTERM)

    def kill(self, unit: UnitId) -> list[str]:
        return [c.spec.name for c in self.members[unit] if c.signal(signal.SIGKILL)]

    def notify(self, unit: UnitId, note: Note) -> None:
        life = self.sup.lives[unit]
        if note == Note.LOST and unit.kind == UnitKind.WORKER_GROUP:  # (a core's own unit restarts it: nobody to tell)
            self.notifier.workers_lost(unit.dp, f"{life.culprit} {life.why}" if life.culprit else str(life.why))
        elif note == Note.DRAIN and not self.notifier.drain(unit.dp):
            self.sup.post(unit, lc.Drained())  # the core is not there to drain: nothing runs on it
        elif note == Note.UP and unit.kind == UnitKind.API_SERVER:
            self.next_api_server()

    def last_words(self, unit: UnitId) -> list[str]:
        name = self.sup.lives[unit].culprit or self.members[unit][0].spec.name
        return self.sup.router.last_lines(name)

    # the deployment

    def serving(self, lives: dict, first: bool) -> bool:
        """Serving once every process is ready; then for as long as it runs (a rank that restarts is routed
        around by the API servers)."""
        return not first or all(life.phase == Phase.READY for life in lives.values())

    def restart(self, role: str | None, dp: int | None, replica: int | None, rolling: bool, now: bool) -> list[str]:
        """`vsup restart`: every unit of `role` (and DP rank), each drained first; `now`: at once, as a crash
        would. (Replicas and rolling restarts are vLLM's: `vsup restart` refuses them here.)"""
        chosen = list(dict.fromkeys(c.unit for c in self.children if c.spec.role == role and c.alive and
                                    (dp is None or c.spec.dp == dp) and self.sup.lives[c.unit].phase in lc.LIVE))
        for unit in chosen:
            if now:
                self.sup.post(unit, lc.RestartAsked(How.NOW))
            elif unit.kind == UnitKind.API_SERVER:
                if unit not in self.waiting:
                    self.waiting.append(unit)
            else:  # an engine core or a worker group drains first; the coordinator holds no request
                self.sup.post(unit, lc.RestartAsked(How.TERM if unit.kind == UnitKind.COORDINATOR else How.DRAIN))
        self.next_api_server()
        return sorted(map(str, chosen))

    def next_api_server(self) -> None:
        """Restart the next waiting API server, once every API server is ready (so the others serve)."""
        servers = [u for u in self.members if u.kind == UnitKind.API_SERVER]
        if any(self.sup.lives[u].phase != Phase.READY for u in servers):
            return
        while self.waiting:
            unit = self.waiting.popleft()
            if self.sup.lives[unit].phase == Phase.READY:
                self.sup.post(unit, lc.RestartAsked(How.TERM))  # it drains itself on SIGTERM
                return

    def stop_order(self) -> list[tuple[list[UnitId], float]]:
        """API servers (each drains for --drain-timeout, then gets --stop-timeout to exit), the coordinator,
        the engine cores, the workers."""
        o = self.sup.options
        kinds = [(UnitKind.API_SERVER, o.drain_timeout + o.stop_timeout), (UnitKind.COORDINATOR, o.stop_timeout),
                 (UnitKind.ENGINE_CORE, o.stop_timeout), (UnitKind.WORKER_GROUP, o.stop_timeout)]
        return [([u for u in self.members if u.kind == kind], grace) for kind, grace in kinds]

    def before_stop(self) -> None:
        pass

    def rows(self) -> list[dict]:
        return [c.to_json(self.state_of(c)) for c in self.children]

    def state_of(self, child: Child) -> str:
        """A process's state as ps shows it, from its units' phases."""
        phases = {self.sup.lives[u].phase for u in self.units_of(child)}
        if child.alive:
            if Phase.STOPPING in phases or self.sup.stopping:
                return ProcessState.STOPPING
            return ProcessState.READY if child.ready else ProcessState.STARTING
        if child.popen is None:
            return ProcessState.PENDING
        for phase, state in ((Phase.FAILED, ProcessState.FAILED), (Phase.BACKOFF, ProcessState.BACKOFF),
                             (Phase.STOPPING, ProcessState.STOPPED), (Phase.STOPPED, ProcessState.STOPPED)):
            if phase in phases:
                return state
        return ProcessState.STOPPED if self.sup.stopping else ProcessState.EXITED

    def cleanup(self) -> None:
        """Remove what the tree left: sockets, rendezvous files, shared-memory rings."""
        self.notifier.close()
        run_dir = self.sup.run_dir
        run_dir.remove_sockets()
        # only the rings that no process holds: a deployment of the same name under another VSUP_HOME
        # may be running, and its rings have the same prefix (listed first: a ring made after the
        # listing is not looked at, one made before it is held by its writer from its creation on)
        rings = [name for name in os.listdir("/dev/shm") if addresses.is_ring_of(run_dir.name, name)]
        in_use = procfs.shm_in_use() if rings else set()
        for name in rings:
            if name not in in_use:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", name))
