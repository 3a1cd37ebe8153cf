"""The supervisor: one deployment's units, each living by `lifecycle.step`, on one event loop, with the
engine behind an adapter (engine_units.py for our engine, vllm_units.py for a stock vLLM).

The supervisor feeds each event to its unit's lifecycle and carries out the actions that come back,
through the adapter; it decides nothing about a unit itself. What it owns is the deployment: its
state, the stop in order, what happens when a unit gives up (units.can_serve), state.json and the
control socket.

An adapter says which units a plan has and what each one's limits are (`units`), starts, signals, kills
and notifies a unit (`spawn`, `signal`, `kill`, `notify`), turns what it sees into events (`supervisor.post`
from the loop's thread), says whether the deployment serves (`serving`), what `vsup restart` asks of
which unit (`restarts`), in what order the stop goes (`stop_order`), and the processes of state.json
(`rows`). For incidents it says what it saw of a unit that went down (`evidence`), what runs (`live`)
and what became of the requests after (`requests_after`). Across nodes, it hears the head's answers on a
headless node (`on_head`) and answers the other nodes on the head (`group_desk`: a stock vLLM's, group.py).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass

from vsup.rundir import RunDir
from vsup.supervisor import lifecycle as lc
from vsup.supervisor import notify, units
from vsup.supervisor.control import ControlServer
from vsup.supervisor.head_watch import HEAD, HeadWatch, head_lost
from vsup.supervisor.incident_keeper import IncidentKeeper
from vsup.supervisor.lifecycle import Life, Phase
from vsup.supervisor.log_format import supervisor_record
from vsup.supervisor.log_router import LogRouter
from vsup.supervisor.loop import Loop
from vsup.supervisor.probes import BEAT_S, Probes
from vsup.supervisor.restart_policy import RestartPolicy
from vsup.supervisor.states import DeploymentState
from vsup.supervisor.units import UnitId
from vsup.topology import ENGINE_CORE

STOP = "stop"  # an inbox item: (STOP, reason)
QUIET_S = 5.0  # a process that starts and says nothing for this long is named, with what it said last


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
    probe_socket: socket.socket | None = None  # --probe-port's, bound by `vsup serve`: the kubelet's probes
    head: tuple[str, int] | None = None  # a headless node's head (host, port): given up after head_timeout
    head_timeout: float = 30.0
    hang_timeout: float = 120.0  # requests waiting and no step for this long: a hang (our engine's cores)
    group_secret: str | None = None  # the cluster secret, with a stock vLLM across nodes: signs group.py's reports


def local_url(url: str) -> str:
    """The serving URL as this host reaches it: 0.0.0.0 (every address) is 127.0.0.1."""
    return url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")


class Supervisor:
    """Runs one deployment until it is stopped or nothing is left to serve."""

    def __init__(self, run_dir: RunDir, options: Options, router: LogRouter, make_adapter):
        """`make_adapter(supervisor)` builds the engine's adapter."""
        self.run_dir, self.options, self.router = run_dir, options, router
        self.loop = Loop(self.on_item)
        self.state = DeploymentState.STARTING
        self.exit_code = 0
        self.message: str | None = None
        self.started_at = time.time()
        self.queue: deque[tuple[UnitId, lc.Event]] = deque()
        self.busy = False
        self.killed: list[str] = []  # what the stop had to SIGKILL
        self.loop_started = time.monotonic()
        self.quiet: dict[str, tuple[float, int]] = {}  # what quiet_starts said last of each process
        self.adapter = make_adapter(self)
        self.lives: dict[UnitId, Life] = {id: Life(str(id), limits) for id, limits in self.adapter.units().items()}
        self.control = ControlServer(str(run_dir.control_socket), self, self.loop)
        self.incidents = IncidentKeeper(run_dir.path, router.tail, self.log,
                                        lambda s, fn: self.loop.at(time.monotonic() + s, fn), self.adapter.plan.roles)
        self.head_answered: float | None = None
        self.head_watch = HeadWatch(options.head, self.loop.post, options.group_secret) if options.head else None
        self.probes = None
        if options.probe_socket is not None:  # a head with ranks on other nodes: its readiness asks /health too
            ranks_elsewhere = options.port_socket is not None and any(p["role"] == ENGINE_CORE
                                                                      for p in self.adapter.remote())
            health = f"{local_url(options.url)}/health" if ranks_elsewhere else None
            self.probes = Probes(options.probe_socket, health, self.adapter.group_desk())

    def log(self, event: str, level: str = "info", **fields) -> None:
        self.router.emit(supervisor_record(event, level, **fields))

    # events in, actions out

    def post(self, unit: UnitId, event: lc.Event) -> None:
        """Feed `event` to `unit`'s lifecycle (on the loop's thread); events that its actions cause follow it,
        each run to completion in turn."""
        self.queue.append((unit, event))
        if self.busy:
            return  # (an outer post is taking the queue in turn)
        self.busy = True
        try:
            while self.queue:
                unit, event = self.queue.popleft()
                before = self.lives[unit]
                life, actions = lc.step(before, event, time.monotonic())
                self.lives[unit] = life
                if life.deadline is not None and life.deadline != before.deadline:
                    self.loop.at(life.deadline, lambda u=unit: self.post(u, lc.Timer()))
                for action in actions:
                    self.carry_out(unit, action)
                if life.phase != before.phase:
                    self.update_state()
        finally:
            self.busy = False

    def carry_out(self, unit: UnitId, action: lc.Action) -> None:
        if isinstance(action, lc.Spawn):
            if self.stopping:  # (a restart that ended while the stop had not reached this unit yet)
                self.post(unit, lc.StopAsked(0.0))  # it does not start again: nothing runs, so it is stopped
            else:
                self.adapter.spawn(unit)
        elif isinstance(action, lc.Signal):
            self.adapter.signal(unit)
        elif isinstance(action, lc.Kill):
            killed = self.adapter.kill(unit)
            if self.lives[unit].phase == Phase.STOPPING:
                self.killed += killed
        elif isinstance(action, lc.Notify):
            self.adapter.notify(unit, action.note)
            if action.note == lc.Note.UP:
                self.incidents.up(str(unit), lambda since, until: self.adapter.requests_after(unit, since, until))
        elif isinstance(action, lc.Record):
            evidence = self.adapter.evidence(unit)
            self.incidents.record(str(unit), evidence["role"], self.lives[unit].why or "", evidence["death"],
                                  evidence["members"], evidence.get("since", 0.0), evidence.get("requests", []),
                                  evidence.get("died_at"), self.adapter.live())
        elif isinstance(action, lc.GiveUp):
            self.gave_up(unit, action.reason)
        elif isinstance(action, lc.Log):
            self.log(action.event, action.level, **dict(action.fields))
        elif isinstance(action, lc.Save):
            self.save()

    def on_item(self, item) -> None:
        """What another thread (or a signal handler) posted to the loop."""
        if isinstance(item, tuple) and item[0] == STOP:
            self.request_stop(item[1])
        elif isinstance(item, tuple) and item[0] == HEAD:
            self.heard_of_head(*item[1:])
        else:
            self.adapter.on_item(item)

    # the deployment

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _: self.loop.post((STOP, f"{signal.Signals(signum).name} received")))
        signal.set_wakeup_fd(self.loop.wake_w)
        self.adapter.before_start()
        for unit in self.lives:
            self.post(unit, lc.Launch())
        timeout = self.adapter.startup_timeout()
        if timeout is not None:
            self.loop.at(time.monotonic() + timeout, self.startup_timed_out)
        self.loop.at(time.monotonic() + 1.0, self.quiet_starts)
        self.sample_memory()
        if self.head_watch is not None:
            self.head_watch.start()
        if self.probes is not None:
            self.probes.start()
            self.publish_probes()
        while not self.stopping:
            self.loop.once()
        self.shutdown()
        return self.exit_code

    @property
    def stopping(self) -> bool:
        return self.state in (DeploymentState.STOPPING, DeploymentState.STOPPED, DeploymentState.FAILED)

    def update_state(self) -> None:
        if self.stopping:
            return
        first = self.state == DeploymentState.STARTING
        if self.adapter.serving(self.lives, first):
            if first:
                self.log(f"serving {self.options.model} on {self.options.url}")
                notify.sd_notify("READY=1")
            self.state = DeploymentState.SERVING
        elif not first:
            self.state = DeploymentState.RESTARTING

    def heard_of_head(self, answered: bool, when: float, reply: dict | None = None) -> None:
        """A headless node gives up once its head has not answered for --health-timeout (head_watch.py); what
        the head answered goes to the adapter."""
        if answered:
            self.head_answered = when
            if reply is not None and not self.stopping:
                self.adapter.on_head(reply)
        elif head_lost(self.head_answered, when, self.options.head_timeout) and not self.stopping:
            host, port = self.options.head
            self.fail(f"the head node at {host}:{port} has not answered for {when - self.head_answered:.0f} s "
                      f"(--health-timeout {self.options.head_timeout:g}): giving up, so that what runs this node "
                      f"starts it again with its head")

    def publish_probes(self) -> None:
        """Every second, from the loop: it turns, and whether every unit of this node is ready (probes.py)."""
        down = [str(u) for u, life in self.lives.items() if life.phase != Phase.READY]
        ready = self.state == DeploymentState.SERVING and not down
        self.probes.publish(ready, str(self.state) + (f"; not ready: {', '.join(down)}" if down else ""))
        self.loop.at(time.monotonic() + BEAT_S, self.publish_probes)

    def sample_memory(self) -> None:
        """Every second: the memory evidence of every live process (incident_keeper.py)."""
        self.incidents.sample(list(self.adapter.live().values()))
        self.loop.at(time.monotonic() + 1.0, self.sample_memory)

    def quiet_starts(self) -> None:
        """While the deployment starts, name each process that is not ready and has been quiet for QUIET_S
        (a cold torch import, a kernel build, a slow disk): a person sees that it is still at work, and where."""
        if self.state != DeploymentState.STARTING:
            return
        now = time.monotonic()
        for name in self.adapter.late(running_only=True):
            when, said = self.router.last_said.get(name, (self.loop_started, None))
            stretch = int((now - when) // QUIET_S)  # once per QUIET_S of one silence
            if stretch and self.quiet.get(name) != (when, stretch):
                self.quiet[name] = (when, stretch)
                self.log("still starting", process=name, quiet_s=stretch * int(QUIET_S), last=said)
        self.loop.at(now + 1.0, self.quiet_starts)

    def startup_timed_out(self) -> None:
        if self.state == DeploymentState.STARTING:
            self.fail(f"startup timeout: not ready after {self.adapter.startup_timeout():g} s: "
                      f"{', '.join(self.adapter.late())}")

    def gave_up(self, unit: UnitId, reason: str) -> None:
        """A unit will not start again: the deployment ends, quoting its last words, unless what is left can
        still serve."""
        words = self.adapter.last_words(unit)[-10:]
        self.log("unit gave up", "error", unit=str(unit), why=reason, last_stderr=words)
        failed = {u for u, life in self.lives.items() if life.phase == Phase.FAILED}
        if units.can_serve(list(self.lives), failed):
            self.log(f"{unit} failed; the rest serves on", "error", why=reason)
            return
        quoted = "\n".join(f"    {line}" for line in words) or "    (no stderr output)"
        self.fail(f"{unit} gave up: {reason}\n{quoted}")

    def request_stop(self, reason: str) -> None:
        if not self.stopping:
            self.message = reason
            self.state = DeploymentState.STOPPING
            self.log("stopping", reason=reason)

    def request_restart(self, role: str | None, dp: int | None, replica: int | None = None,
                        rolling: bool = False, now: bool = False) -> list[str]:
        """`vsup restart`: the adapter chooses the units and how each ends; the names of those it took on."""
        return self.adapter.restart(role, dp, replica, rolling, now)

    @property
    def loads(self) -> dict[str, dict]:
        """Each process's last load report (engine/load.py), for ps."""
        return self.adapter.loads

    def fail(self, message: str) -> None:
        self.log(message, "error")
        self.message, self.exit_code, self.state = message, 1, DeploymentState.FAILED

    def shutdown(self) -> None:
        """Stop the units in the adapter's order, each group given its grace before SIGKILL."""
        notify.sd_notify("STOPPING=1")
        if self.options.port_socket is not None:  # once the processes that serve it close it too, new
            self.options.port_socket.close()      # connections are refused
        self.adapter.before_stop()
        self.save()
        for group, grace_s in self.adapter.stop_order():
            for unit in group:
                self.post(unit, lc.StopAsked(grace_s))
            while any(self.lives[u].running for u in group):
                self.loop.once(0.1)
        while any(life.running for life in self.lives.values()):  # (those that gave up: killed already)
            self.loop.once(0.1)
        if self.killed:
            self.log("killed with SIGKILL after --stop-timeout", "warning", processes=self.killed)
            if self.exit_code == 0 and self.state == DeploymentState.STOPPING:  # (systemd counts it a failed stop)
                self.exit_code = 1
                self.message = f"stop needed SIGKILL for {', '.join(self.killed)} (--stop-timeout " \
                               f"{self.options.stop_timeout:g} s)"
        self.control.close()
        if self.head_watch is not None:
            self.head_watch.stop()
        if self.probes is not None:
            self.probes.close()
        self.adapter.cleanup()
        if self.state == DeploymentState.STOPPING:
            self.state = DeploymentState.STOPPED
        self.save()
        self.loop.close()

    # state

    def snapshot(self) -> dict:
        return {"supervisor": {"pid": os.getpid(), "name": self.run_dir.name, "engine": self.adapter.engine,
                               "model": self.options.model, "url": self.options.url, "state": self.state,
                               "started_at": self.started_at, "message": self.message,
                               "formula": self.adapter.formula()},
                "units": {str(u): {"state": life.phase, "restarts": life.restarts.total, "why": life.why,
                                   **self.adapter.unit_extra(u)} for u, life in self.lives.items()},
                "processes": self.adapter.rows(),
                "incidents": {"last": self.incidents.last, "counts": self.incidents.counts},
                "remote": self.adapter.remote()}

    def save(self) -> None:
        self.run_dir.write_state(self.snapshot())
