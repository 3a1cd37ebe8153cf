"""The lifecycle of one restart unit, as one pure transition function: `step(life, event, now)` returns the
unit's next `Life` and the actions that the supervisor carries out. No I/O and no clock: time comes in as
`now`, and what the world did comes in as events.

Every unit of both engines runs through it: a worker group, an engine core with its group, an API server,
the coordinator, a stock vLLM tree (a replica) and vsup's front. What differs between them (which
processes a unit has, what its SIGTERM asks of them, whether an exit 0 is a failure) is the engine
adapter's to say; when to restart, back off or give up is said here and in `restart_policy.decide`, once.

    PENDING --Launch--> STARTING --Ready/HealthOk--> READY
    STARTING, READY --Exited/HealthFailed/Stalled/startup timeout--> BACKOFF --Timer, all gone--> STARTING
                                                              \\--> FAILED (the policy or the start limit)
    STARTING, READY --RestartAsked(DRAIN)--> DRAINING --Drained/Timer--> ENDING --all gone--> STARTING
    STARTING, READY --RestartAsked(TERM)--> ENDING;  --RestartAsked(NOW)--> BACKOFF (at once)
    any but FAILED, STOPPED --StopAsked--> STOPPING --all gone--> STOPPED

docs/ARCHITECTURE.md holds the whole table, generated from `step` (tests/vsup/test_lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from vsup.supervisor.restart_policy import Restarts, RestartPolicy, decide


class Phase(StrEnum):
    PENDING = "pending"      # not started yet
    STARTING = "starting"    # spawned, not ready yet
    READY = "ready"          # serving
    DRAINING = "draining"    # a restart asked for: its engine core finishes what runs first
    ENDING = "ending"        # a restart asked for: SIGTERM sent, it exits by itself (SIGKILL at the deadline)
    BACKOFF = "backoff"      # down, or going down: starts again at the deadline, once every process is gone
    FAILED = "failed"        # it gave up: never starts again
    STOPPING = "stopping"    # the deployment stops
    STOPPED = "stopped"


LIVE = (Phase.STARTING, Phase.READY)  # an exit in these was not asked for


class How(StrEnum):
    """How a restart asked for (`vsup restart`) ends the unit."""

    NOW = "now"      # SIGKILL at once (`--now`, and a vLLM tree's `--role`)
    DRAIN = "drain"  # its engine core finishes its running requests first, then SIGTERM
    TERM = "term"    # SIGTERM: it finishes what it holds itself within --drain-timeout


class Note(StrEnum):
    """What the supervisor tells others of the unit (Notify)."""

    LOST = "lost"    # it is going down (an engine core loses its workers; the front, a tree)
    DRAIN = "drain"  # ask its engine core to finish what runs and start nothing new
    UP = "up"        # it serves (again)


# events

@dataclass(frozen=True)
class Launch:
    """The deployment starts it, the first time."""


@dataclass(frozen=True)
class Started:
    """One of its processes started: spawned, or introduced (a vLLM process's hello)."""

    pid: int


@dataclass(frozen=True)
class Ready:
    """Every process of it said it is ready."""


@dataclass(frozen=True)
class Exited:
    """A process of it ended, which ends the unit if it was running (`failure`: whether the exit counts as one
    under --restart-policy on-failure; `exit`: as ps spells it, `exit 1` or `signal 9 (SIGKILL)`)."""

    pid: int
    process: str
    exit: str
    failure: bool = True


@dataclass(frozen=True)
class Reaped:
    """A process of it ended that does not end it by itself: the unit is ending anyway, or the process
    belongs to another unit too (a worker of an engine core's unit), or it is a helper that may end."""

    pid: int


@dataclass(frozen=True)
class HealthOk:
    """Its health probe answered (a vLLM tree's /health): a starting tree is ready."""


@dataclass(frozen=True)
class HealthFailed:
    why: str


@dataclass(frozen=True)
class Stalled:
    """Requests wait and no token comes out (vllm/progress.py)."""

    why: str


@dataclass(frozen=True)
class Drained:
    """Its engine core finished what ran (or could not be asked)."""


@dataclass(frozen=True)
class StopAsked:
    """The deployment stops: SIGTERM, and SIGKILL after `grace_s`."""

    grace_s: float


@dataclass(frozen=True)
class RestartAsked:
    how: How


@dataclass(frozen=True)
class Timer:
    """Its deadline may have come."""


Event = Launch | Started | Ready | Exited | Reaped | HealthOk | HealthFailed | Stalled | Drained | StopAsked | \
    RestartAsked | Timer


# actions

@dataclass(frozen=True)
class Spawn:
    """Start its processes (the adapter reports each as Started)."""


@dataclass(frozen=True)
class Signal:
    """SIGTERM to it: it ends by itself (a drained engine core, an API server, vsup's front, `vllm serve`)."""


@dataclass(frozen=True)
class Kill:
    """SIGKILL to every process of it: a TP/PP group cannot go on without one of its ranks."""


@dataclass(frozen=True)
class Notify:
    note: Note


@dataclass(frozen=True)
class GiveUp:
    """It will not start again: the supervisor sees whether anything is left to serve (units.can_serve)."""

    reason: str


@dataclass(frozen=True)
class Log:
    event: str
    level: str = "info"
    fields: tuple = ()  # (name, value) pairs


@dataclass(frozen=True)
class Record:
    """It went down unasked: keep the evidence (an incident: incidents.py), before what is left of it is
    killed and before it restarts."""


@dataclass(frozen=True)
class Save:
    """Its state changed: write state.json (and, with vLLM, tell the front)."""


Action = Spawn | Signal | Kill | Notify | GiveUp | Log | Record | Save


@dataclass(frozen=True)
class Limits:
    """What a unit's lifecycle is held to (its flags)."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    drain_s: float = 30.0
    stop_s: float = 10.0
    startup_s: float | None = None  # None: the deployment's own startup timeout stands for it


@dataclass(frozen=True)
class Life:
    """Where one unit stands."""

    name: str                      # how ps spells the unit: `worker-group dp0`, `vllm r1`, `front`
    limits: Limits = field(default_factory=Limits)
    phase: Phase = Phase.PENDING
    running: frozenset[int] = frozenset()  # the pids of its processes still running
    since: float = 0.0             # when it was last spawned
    deadline: float | None = None  # when a Timer acts: the start (BACKOFF), SIGTERM, SIGKILL, the startup timeout
    restarts: Restarts = Restarts()
    culprit: str | None = None     # the process whose end took it down last
    why: str | None = None         # how it went down last: an exit, a probe, a timeout


def step(life: Life, event: Event, now: float) -> tuple[Life, list[Action]]:
    """The unit's next Life and the actions to carry out. A pair of phase and event that cannot happen
    leaves the life as it is, with no action."""
    phase = life.phase
    if isinstance(event, Started):
        return _started(life, event)
    if isinstance(event, (Exited, Reaped)):
        return _ended(life, event, now)
    if isinstance(event, Launch):
        return _spawn(life, now) if phase == Phase.PENDING else (life, [])
    if isinstance(event, StopAsked):
        return _stop(life, event, now)
    if isinstance(event, (Ready, HealthOk)):
        if phase != Phase.STARTING:
            return life, []
        return replace(life, phase=Phase.READY, deadline=None), [Notify(Note.UP), Save()]
    if isinstance(event, (HealthFailed, Stalled)):
        return _down(life, now, None, event.why) if phase == Phase.READY else (life, [])
    if isinstance(event, RestartAsked):
        return _asked(life, event.how, now) if phase in LIVE else (life, [])
    if isinstance(event, Drained):
        return _end(life, now, life.limits.stop_s) if phase == Phase.DRAINING else (life, [])
    return _timer(life, now)


def _started(life: Life, event: Started) -> tuple[Life, list[Action]]:
    if life.phase == Phase.PENDING:
        return life, []
    life = replace(life, running=life.running | {event.pid})
    killed = life.phase in (Phase.ENDING, Phase.STOPPING) and life.deadline is None  # (its SIGKILL went out)
    if life.phase in (Phase.BACKOFF, Phase.FAILED, Phase.STOPPED) or killed:
        return life, [Kill()]  # a process that a dying tree started late: it must not outlive the tree
    return life, [Save()]


def _ended(life: Life, event: Exited | Reaped, now: float) -> tuple[Life, list[Action]]:
    if event.pid not in life.running:
        return life, []
    life = replace(life, running=life.running - {event.pid})
    if isinstance(event, Exited) and life.phase in LIVE:
        return _down(life, now, event.process, event.exit, event.failure)
    if isinstance(event, Exited) and life.phase == Phase.DRAINING:  # a group cannot drain without a rank
        life = replace(life, phase=Phase.ENDING, deadline=now + life.limits.stop_s)
        if life.running:
            return life, [Kill(), Notify(Note.LOST), Save()]
    if life.running:
        return life, [Save()]
    if life.phase == Phase.STOPPING:
        return replace(life, phase=Phase.STOPPED, deadline=None), [Save()]
    if life.phase in (Phase.DRAINING, Phase.ENDING):  # a restart asked for: at once, counted in the total only
        return _spawn(replace(life, restarts=life.restarts.asked()), now)
    if life.phase == Phase.BACKOFF and now >= life.deadline:
        return _spawn(life, now)
    return life, [Save()]


def _down(life: Life, now: float, process: str | None, why: str, failure: bool = True
          ) -> tuple[Life, list[Action]]:
    """It went down unasked: the rest of it is killed, and it restarts after its backoff, or gives up."""
    decision = decide(life.limits.policy, life.restarts, now, life.since, failure)
    life = replace(life, restarts=decision.restarts, culprit=process, why=why)
    actions: list[Action] = [Record(), *([Kill()] if life.running else [])]
    actions.append(Notify(Note.LOST))
    if decision.delay is None:
        last = why if process in (None, life.name) else f"{process} {why}"
        reason = f"{decision.why_not} (last exit: {last})" if process else f"{decision.why_not} ({last})"
        return replace(life, phase=Phase.FAILED, deadline=None), [*actions, GiveUp(reason), Save()]
    life = replace(life, phase=Phase.BACKOFF, deadline=now + decision.delay)
    return life, [*actions, Log("restarting", fields=(("process", life.name), ("delay_s", decision.delay))), Save()]


def _asked(life: Life, how: How, now: float) -> tuple[Life, list[Action]]:
    life = replace(life, culprit=None, why="vsup restart")
    if how == How.NOW:
        life = replace(life, phase=Phase.BACKOFF, deadline=now, restarts=life.restarts.asked())
        return life, [Kill(), Notify(Note.LOST), Log("restarting", fields=(("process", life.name),)), Save()]
    if how == How.DRAIN:
        life = replace(life, phase=Phase.DRAINING, deadline=now + life.limits.drain_s)
        return life, [Notify(Note.DRAIN), Log("draining", fields=(("process", life.name),)), Save()]
    return _end(life, now, life.limits.drain_s + life.limits.stop_s)


def _end(life: Life, now: float, grace_s: float) -> tuple[Life, list[Action]]:
    """SIGTERM, for a restart asked for; SIGKILL after `grace_s`."""
    life = replace(life, phase=Phase.ENDING, deadline=now + grace_s)
    return life, [Signal(), Notify(Note.LOST), Log("restarting gracefully", fields=(("process", life.name),)),
                  Save()]


def _spawn(life: Life, now: float) -> tuple[Life, list[Action]]:
    startup = life.limits.startup_s
    life = replace(life, phase=Phase.STARTING, since=now, running=frozenset(),
                   deadline=None if startup is None else now + startup)
    return life, [Spawn(), Save()]


def _stop(life: Life, event: StopAsked, now: float) -> tuple[Life, list[Action]]:
    if life.phase in (Phase.FAILED, Phase.STOPPING, Phase.STOPPED):
        return life, []
    if not life.running:
        return replace(life, phase=Phase.STOPPED, deadline=None), [Save()]
    return replace(life, phase=Phase.STOPPING, deadline=now + event.grace_s), [Signal(), Save()]


def _timer(life: Life, now: float) -> tuple[Life, list[Action]]:
    if life.deadline is None or now < life.deadline:
        return life, []
    phase = life.phase
    if phase == Phase.STARTING:
        return _down(life, now, None, f"startup timeout: not ready after {life.limits.startup_s:g} s")
    if phase == Phase.DRAINING:
        life, actions = _end(life, now, life.limits.stop_s)
        return life, [Log("drain overran --drain-timeout; restarting anyway", "warning",
                          (("process", life.name),)), *actions]
    if phase in (Phase.ENDING, Phase.STOPPING):
        return replace(life, deadline=None), [Kill()]
    if phase == Phase.BACKOFF and not life.running:
        return _spawn(life, now)
    return life, []
