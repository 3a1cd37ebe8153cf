"""The lifecycle: start the plan, learn of each death from the process itself, restart by unit,
stop in order. One thread and one selector: pidfds, the control socket, a wakeup pipe."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass

from vsup import addresses, procfs
from vsup.rundir import RunDir
from vsup.supervisor import notify, units
from vsup.supervisor.child import Child
from vsup.supervisor.control import ControlServer
from vsup.supervisor.graceful import GracefulRestarts, Phase
from vsup.supervisor.log_format import supervisor_record
from vsup.supervisor.log_router import LogRouter
from vsup.supervisor.restart_policy import RestartPolicy, RestartState
from vsup.supervisor.states import DeploymentState, ProcessState, UnitState
from vsup.topology import API_SERVER, COORDINATOR, ENGINE_CORE, WORKER, Plan


@dataclass
class Options:
    model: str
    url: str
    restart_policy: RestartPolicy
    startup_timeout: float = 600.0
    drain_timeout: float = 30.0
    stop_timeout: float = 10.0
    env: dict | None = None
    placement: dict | None = None  # process name -> vsup.placement.Placement; None: nothing pinned
    # the public port, bound by `vsup serve` and held until the stop: every process that serves it (the API
    # servers, vsup's front) gets this socket (--listen-fd), so a connection that waits to be accepted
    # outlives the death of any one of them, and one made while the only one restarts waits for it
    port_socket: socket.socket | None = None


def placement_env(where, env: dict) -> dict:
    """What a child reads at start (engine/process.py) to place itself: its CPUs, threads and nice value;
    a user's OMP_NUM_THREADS wins over the threads."""
    return {"VSUP_THREADS": str(where.threads), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", str(where.threads)),
            **({"VSUP_CPUS": ",".join(map(str, where.cpus))} if where.cpus else {}),
            **({"VSUP_NICE": str(where.nice)} if where.nice else {})}


class Unit:
    """A restart unit as the supervisor runs it: its processes and restart history."""

    def __init__(self, id: units.UnitId, children: list[Child], policy: RestartPolicy):
        self.id, self.children = id, children
        self.restart = RestartState(policy)
        self.state = UnitState.RUNNING
        self.restart_at: float | None = None
        self.started_at = time.monotonic()
        self.requested = False  # its next exit was asked for (vsup restart): it restarts at once
        self.phase: str | None = None  # a graceful restart under way (graceful.py), and until when
        self.phase_until = 0.0


class Supervisor:
    """Runs one deployment's tree until it is stopped or nothing is left to serve."""

    def __init__(self, plan: Plan, run_dir: RunDir, options: Options, router: LogRouter):
        self.plan, self.run_dir, self.options, self.router = plan, run_dir, options, router
        self.node = plan.nodes()[0]
        specs = list(plan.on_node(self.node))
        self.children = [Child(spec, units.unit_of(spec)) for spec in specs]
        self.units = {id: Unit(id, [c for c in self.children if c.spec in units.members(id, specs)],
                               options.restart_policy) for id in units.units(specs)}
        self.generation: dict[int, int] = {}
        self.state = DeploymentState.STARTING
        self.exit_code = 0
        self.message: str | None = None
        self.started_at = time.time()
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.ready_events: deque[str] = deque()
        self.loads: dict[str, dict] = {}  # process name -> its last load report (engine/load.py)
        self.graceful = GracefulRestarts(self)
        self.control = ControlServer(str(run_dir.control_socket), self)
        self.selector.register(self.control.sock, selectors.EVENT_READ, "control")
        self.notifier = notify.CoreNotifier(run_dir)

    # logging

    def log(self, event: str, level: str = "info", **fields) -> None:
        self.router.emit(supervisor_record(event, level, **fields))

    def on_load(self, record: dict) -> None:
        """Called on the router's thread for every child's load report: the last one is kept for ps."""
        self.loads[record["name"]] = {**record, "received_at": time.time()}

    def on_records(self, records: list[dict]) -> None:
        """Called on the router's thread for every batch of lines: READY reports wake the main loop."""
        for record in records:
            if record.get("event") == "ready" and record.get("stream") == "stdout":
                self.ready_events.append(record["name"])
                os.write(self.wake_w, b"r")
            elif record.get("event") == "drained" and record.get("stream") == "stdout":
                self.graceful.drained.append(record["name"])
                os.write(self.wake_w, b"d")

    # the loop

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _: self.request_stop(f"{signal.Signals(signum).name} received"))
        signal.set_wakeup_fd(self.wake_w)
        self.start(self.children)
        deadline = time.monotonic() + self.options.startup_timeout
        while not self.stopping:
            self.tick(timeout=self.next_timer())
            if self.state == DeploymentState.STARTING and time.monotonic() > deadline:
                late = ", ".join(c.spec.name for c in self.children if c.state != ProcessState.READY)
                self.fail(f"startup timeout: not ready after {self.options.startup_timeout:g} s: {late}")
        self.shutdown()
        return self.exit_code

    @property
    def stopping(self) -> bool:
        return self.state in (DeploymentState.STOPPING, DeploymentState.STOPPED, DeploymentState.FAILED)

    def next_timer(self) -> float:
        now = time.monotonic()
        waits = [u.restart_at - now for u in self.units.values() if u.state == UnitState.BACKOFF]
        phase_until = self.graceful.next_wake()
        return max(0.0, min([1.0, *waits, *([phase_until - now] if phase_until is not None else [])]))

    def tick(self, timeout: float | None) -> None:
        for key, _ in self.selector.select(timeout):
            if key.data == "wake":
                os.read(self.wake_r, 4096)
            elif key.data == "control":
                self.control.accept()
            else:
                self.on_exit(key.data)
        while self.ready_events:
            self.on_ready(self.ready_events.popleft())
        self.graceful.tick()
        now = time.monotonic()
        for unit in self.units.values():
            if unit.state == UnitState.BACKOFF and now >= unit.restart_at and not self.stopping:
                self.restart(unit)

    # starting

    def start(self, children: list[Child]) -> None:
        env = {**os.environ, **(self.options.env or {}), "VSUP_SUPERVISOR_PID": str(os.getpid()),
               "VSUP_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}
        for dp in {c.spec.dp for c in children if c.spec.role == WORKER}:
            self.generation[dp] = self.generation.get(dp, 0) + 1
        for child in children:
            spec = child.spec
            if spec.role == WORKER:
                child.extra_argv = ["--dist-init-method", addresses.dist_init_method(
                    str(self.run_dir.path), spec.dp, self.generation[spec.dp], self.plan.config.master)]
            port = ()
            if spec.role == API_SERVER:
                child.extra_argv, port = self.port_args()
            where = (self.options.placement or {}).get(spec.name)
            out, err = child.spawn({**env, **placement_env(where, env)} if where else env, pass_fds=port)
            if spec.role == ENGINE_CORE:
                self.notifier.connect(spec.dp)
            tag = {"name": spec.name, "role": spec.role, "a": spec.a, "dp": spec.dp, "pp": spec.pp, "tp": spec.tp,
                   "pid": child.pid}
            self.router.add(out, "stdout", tag)
            self.router.add(err, "stderr", tag)
            self.selector.register(child.pidfd, selectors.EVENT_READ, child)
            self.log("started", process=spec.name, pid=child.pid)
        self.save()

    def port_args(self) -> tuple[list[str], tuple[int, ...]]:
        """For a process that serves the public port: the argv naming the held socket, and its fd to pass
        (neither when none is held, or once the stop began)."""
        sock = self.options.port_socket
        if sock is None or sock.fileno() < 0:
            return [], ()
        return ["--listen-fd", str(sock.fileno())], (sock.fileno(),)

    def release_port(self) -> None:
        """At the stop: once the processes that serve the port close it too, new connections are refused."""
        if self.options.port_socket is not None:
            self.options.port_socket.close()

    def on_ready(self, name: str) -> None:
        child = next((c for c in self.children if c.spec.name == name and c.alive), None)
        if child is None or child.state == ProcessState.READY:
            return
        child.state = ProcessState.READY
        self.log("ready", process=name, pid=child.pid, seconds=round(time.time() - child.started_at, 1))
        if self.state == DeploymentState.STARTING and all(c.state == ProcessState.READY for c in self.children):
            self.state = DeploymentState.SERVING
            self.log(f"serving {self.options.model} on {self.options.url}")
            notify.sd_notify("READY=1")
        if self.graceful.waiting:
            self.graceful.next_api_server()
        self.save()

    # deaths and restarts

    def on_exit(self, child: Child) -> None:
        if child.pidfd is None:
            return  # seen already: a worker's exit handles its core's first, and both may be in one select
        if child.spec.role == WORKER:  # a worker follows its vanished core out: the core's exit is the cause
            core = next((c for c in self.children if c.spec.role == ENGINE_CORE and c.spec.dp == child.spec.dp), None)
            if core is not None and core.pidfd is not None and core.popen.poll() is not None:
                self.on_exit(core)
        self.selector.unregister(child.pidfd)
        code = child.reap()
        unit = self.units[child.unit]
        if self.stopping:
            child.state = ProcessState.STOPPED
            self.log("process stopped", process=child.spec.name, pid=child.pid, exit=child.last_exit)
            self.save()
            return
        child.state = ProcessState.EXITED
        if any(u.state != UnitState.RUNNING for u in self.units.values() if child in u.children):
            self.save()
            return  # we ended it ourselves, as part of restarting or failing its unit
        self.log("process exited", "warning" if unit.requested else "error", process=child.spec.name,
                 pid=child.pid, exit=child.last_exit)
        if unit.phase != Phase.ENDING:  # (a graceful restart's SIGTERM ends the others by themselves)
            for other in unit.children:
                other.signal(signal.SIGKILL)  # a TP/PP group cannot go on without one of its ranks
        if child.spec.role == WORKER:  # (a dead core restarts with its group: nobody to tell)
            self.notifier.workers_lost(child.spec.dp, f"{child.spec.name} {child.last_exit}")
        if not unit.restart.wants_restart(code, unit.requested):
            self.fail_unit(unit, child, f"{child.last_exit}; --restart-policy {unit.restart.policy.policy}")
            return
        delay = unit.restart.next_delay(time.monotonic(), unit.started_at, requested=unit.requested)
        unit.requested, unit.phase = False, None
        if delay is None:
            policy = unit.restart.policy
            self.fail_unit(unit, child, f"{policy.max_restarts} restarts within {policy.window_s:g} s")
            return
        unit.state, unit.restart_at = UnitState.BACKOFF, time.monotonic() + delay
        for c in unit.children:
            c.state = ProcessState.BACKOFF
        self.log("restarting", process=str(unit.id), delay_s=delay)
        self.save()

    def restart(self, unit: Unit) -> None:
        if any(c.alive for c in unit.children):
            unit.restart_at = time.monotonic() + 0.1  # the killed members have not exited yet
            return
        unit.state, unit.started_at = UnitState.RUNNING, time.monotonic()
        for child in unit.children:
            child.restarts += 1
        self.start(unit.children)

    def request_restart(self, role: str, dp: int | None, replica: int | None = None, rolling: bool = False,
                        now: bool = False) -> list[str]:
        """`vsup restart`: every unit of `role` (and DP rank), each drained first (graceful.py); `now`: the
        same path as a crash. (Replicas and rolling restarts are vLLM's: `vsup restart` refuses them here.)"""
        victims = [c for c in self.children if c.spec.role == role and (dp is None or c.spec.dp == dp) and c.alive]
        chosen = list(dict.fromkeys(c.unit for c in victims if self.units[c.unit].state == UnitState.RUNNING
                                    and self.units[c.unit].phase is None))
        if now:
            for child in victims:
                if child.unit in chosen:
                    self.units[child.unit].requested = True
                    child.signal(signal.SIGKILL)
        else:
            self.graceful.request(chosen)
        return sorted(map(str, chosen))

    def fail_unit(self, unit: Unit, child: Child, why: str) -> None:
        tail = list(self.router.last_stderr.get(child.spec.name, []))[-10:]
        unit.state = UnitState.FAILED
        for c in unit.children:
            c.state = ProcessState.FAILED
            c.signal(signal.SIGKILL)
        failed = {u.id for u in self.units.values() if u.state == UnitState.FAILED}
        if unit.id.kind == units.UnitKind.WORKER_GROUP:  # a core without workers cannot serve either
            failed.add(units.UnitId.engine_core(unit.id.dp))
        self.log("unit failed", "error", unit=str(unit.id), why=why, last_stderr=tail)
        self.save()
        if not units.can_serve([c.spec for c in self.children], failed):
            quoted = "\n".join(f"    {line}" for line in tail) or "    (no stderr output)"
            self.fail(f"nothing left to serve: {unit.id} failed ({why}); last stderr of {child.spec.name}:\n{quoted}")

    # stopping

    def request_stop(self, reason: str) -> None:
        if not self.stopping:
            self.message = reason
            self.state = DeploymentState.STOPPING
            self.log("stopping", reason=reason)

    def fail(self, message: str) -> None:
        self.log(message, "error")
        self.message, self.exit_code, self.state = message, 1, DeploymentState.FAILED

    def shutdown(self) -> None:
        """Drain and stop in order: API servers, coordinator, engine cores, workers; SIGKILL stragglers."""
        notify.sd_notify("STOPPING=1")
        self.release_port()
        self.save()
        # an API server drains for --drain-timeout itself, then gets --stop-timeout to exit, as the others
        order = [(API_SERVER, self.options.drain_timeout + self.options.stop_timeout),
                 (COORDINATOR, self.options.stop_timeout), (ENGINE_CORE, self.options.stop_timeout),
                 (WORKER, self.options.stop_timeout)]
        killed = []
        for role, timeout in order:
            group = [c for c in self.children if c.spec.role == role and c.alive]
            for child in group:
                child.state = ProcessState.STOPPING
                child.signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while any(c.alive for c in group) and time.monotonic() < deadline:
                self.tick(timeout=0.1)
            killed += [c.spec.name for c in group if c.alive]
            for child in group:
                child.signal(signal.SIGKILL)
        while any(c.alive for c in self.children):
            self.tick(timeout=0.1)
        if killed:
            self.log("killed with SIGKILL after --stop-timeout", "warning", processes=killed)
            if self.exit_code == 0 and self.state == DeploymentState.STOPPING:  # (systemd counts it a failed stop)
                self.exit_code = 1
                self.message = f"stop needed SIGKILL for {', '.join(killed)} (--stop-timeout " \
                               f"{self.options.stop_timeout:g} s)"
        self.cleanup()
        if self.state == DeploymentState.STOPPING:
            self.state = DeploymentState.STOPPED
        self.save()

    def cleanup(self) -> None:
        """Remove what the tree left: sockets, rendezvous files, shared-memory rings."""
        self.control.close()
        self.notifier.close()
        for entry in os.scandir(self.run_dir.path):
            if entry.name.endswith(".sock") or "-dist-" in entry.name:
                os.unlink(entry.path)
        # only the rings that no process holds: a deployment of the same name under another VSUP_HOME
        # may be running, and its rings have the same prefix (listed first: a ring made after the
        # listing is not looked at, one made before it is held by its writer from its creation on)
        rings = [name for name in os.listdir("/dev/shm") if addresses.is_ring_of(self.run_dir.name, name)]
        in_use = procfs.shm_in_use() if rings else set()
        for name in rings:
            if name not in in_use:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", name))

    # state

    def snapshot(self) -> dict:
        return {"supervisor": {"pid": os.getpid(), "name": self.run_dir.name, "engine": "vsup", "model": self.options.model,
                               "url": self.options.url, "state": self.state, "started_at": self.started_at,
                               "message": self.message, "formula": self.plan.formula},
                "units": {str(u.id): {"state": u.state, "restarts": u.restart.total} for u in self.units.values()},
                "processes": [c.to_json() for c in self.children],
                "remote": [p.to_json() for p in self.plan.processes if p.node != self.node]}

    def save(self) -> None:
        self.run_dir.write_state(self.snapshot())
