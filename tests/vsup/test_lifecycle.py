"""The lifecycle of a restart unit, pure and with a fake clock: every phase against every event, for every
kind of unit of both engines, and giving up for each kind. docs/ARCHITECTURE.md's table is generated here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from vsup.supervisor import lifecycle as lc
from vsup.supervisor.lifecycle import How, Life, Limits, Note, Phase
from vsup.supervisor.restart_policy import RestartPolicy

REPO = Path(__file__).resolve().parents[2]
NOW = 1000.0

# each kind of unit with the limits its engine's adapter gives it: only a vLLM tree has a startup timeout
# of its own (our engine's is the deployment's), and vLLM's exits are failures whatever their code
KINDS = {
    "worker-group dp0": Limits(),
    "engine-core dp0": Limits(),
    "api-server a0": Limits(),
    "coordinator": Limits(),
    "vllm r1": Limits(startup_s=600.0),
    "front": Limits(),
}

# where a unit may stand, as the table shows it: (label, phase, pids running, deadline come)
SITUATIONS = [
    ("pending", Phase.PENDING, (), False),
    ("starting", Phase.STARTING, (1, 2), True),
    ("ready", Phase.READY, (1, 2), False),
    ("draining", Phase.DRAINING, (1, 2), True),
    ("ending, one process left", Phase.ENDING, (1,), True),
    ("backoff, one process left", Phase.BACKOFF, (1,), True),
    ("backoff, all gone", Phase.BACKOFF, (), True),
    ("failed, one process left", Phase.FAILED, (1,), False),
    ("stopping, one process left", Phase.STOPPING, (1,), True),
    ("stopped", Phase.STOPPED, (), False),
]

EVENTS = {
    "Launch": lc.Launch(),
    "Started": lc.Started(3),
    "Ready": lc.Ready(),
    "Exited": lc.Exited(1, "worker dp0 pp0 tp0", "signal 9 (SIGKILL)"),
    "Reaped": lc.Reaped(1),
    "HealthOk": lc.HealthOk(),
    "HealthFailed": lc.HealthFailed("/health failing for 30 s"),
    "Stalled": lc.Stalled("no token for 120 s"),
    "Drained": lc.Drained(),
    "StopAsked": lc.StopAsked(10.0),
    "RestartAsked(now)": lc.RestartAsked(How.NOW),
    "RestartAsked(drain)": lc.RestartAsked(How.DRAIN),
    "RestartAsked(term)": lc.RestartAsked(How.TERM),
    "Timer": lc.Timer(),
}

LOST, UP, DRAIN = f"Notify({Note.LOST})", f"Notify({Note.UP})", f"Notify({Note.DRAIN})"
# a death unasked: its evidence kept (an incident), the rest killed, then backoff
DOWN = ("backoff", ["Record", "Kill", LOST, "Log(restarting)", "Save"])
ENDS = ("ending", ["Signal", LOST, "Log(restarting gracefully)", "Save"])
SPAWN = ("starting", ["Spawn", "Save"])
KEPT = "(same)"

# the specification: what each situation does with each event; every pair not here leaves the unit as it
# is, with no action (it cannot happen, or changes nothing)
EXPECTED = {
    ("pending", "Launch"): SPAWN,
    ("pending", "StopAsked"): ("stopped", ["Save"]),
    **{(s, "Started"): (KEPT, ["Save"]) for s in ("starting", "ready", "draining", "ending, one process left",
                                                  "stopping, one process left")},
    **{(s, "Started"): (KEPT, ["Kill"]) for s in ("backoff, one process left", "backoff, all gone",
                                                  "failed, one process left", "stopped")},
    ("starting", "Ready"): ("ready", [UP, "Save"]),
    ("starting", "HealthOk"): ("ready", [UP, "Save"]),
    ("starting", "Exited"): DOWN,
    ("starting", "Reaped"): (KEPT, ["Save"]),
    ("starting", "StopAsked"): ("stopping", ["Signal", "Save"]),
    ("starting", "RestartAsked(now)"): ("backoff", ["Kill", LOST, "Log(restarting)", "Save"]),
    ("starting", "RestartAsked(drain)"): ("draining", [DRAIN, "Log(draining)", "Save"]),
    ("starting", "RestartAsked(term)"): ENDS,
    ("starting", "Timer"): ("startup timeout", DOWN[1]),  # only where the unit has a startup timeout
    ("ready", "Exited"): DOWN,
    ("ready", "Reaped"): (KEPT, ["Save"]),
    ("ready", "HealthFailed"): DOWN,
    ("ready", "Stalled"): DOWN,
    ("ready", "StopAsked"): ("stopping", ["Signal", "Save"]),
    ("ready", "RestartAsked(now)"): ("backoff", ["Kill", LOST, "Log(restarting)", "Save"]),
    ("ready", "RestartAsked(drain)"): ("draining", [DRAIN, "Log(draining)", "Save"]),
    ("ready", "RestartAsked(term)"): ENDS,
    ("draining", "Exited"): ("ending", ["Kill", LOST, "Save"]),
    ("draining", "Reaped"): (KEPT, ["Save"]),
    ("draining", "Drained"): ENDS,
    ("draining", "StopAsked"): ("stopping", ["Signal", "Save"]),
    ("draining", "Timer"): ("ending", ["Log(drain overran --drain-timeout; restarting anyway)", *ENDS[1]]),
    ("ending, one process left", "Exited"): SPAWN,
    ("ending, one process left", "Reaped"): SPAWN,
    ("ending, one process left", "StopAsked"): ("stopping", ["Signal", "Save"]),
    ("ending, one process left", "Timer"): (KEPT, ["Kill"]),
    ("backoff, one process left", "Exited"): SPAWN,
    ("backoff, one process left", "Reaped"): SPAWN,
    ("backoff, one process left", "StopAsked"): ("stopping", ["Signal", "Save"]),
    ("backoff, all gone", "StopAsked"): ("stopped", ["Save"]),
    ("backoff, all gone", "Timer"): SPAWN,
    ("failed, one process left", "Exited"): (KEPT, ["Save"]),
    ("failed, one process left", "Reaped"): (KEPT, ["Save"]),
    ("stopping, one process left", "Exited"): ("stopped", ["Save"]),
    ("stopping, one process left", "Reaped"): ("stopped", ["Save"]),
    ("stopping, one process left", "Timer"): (KEPT, ["Kill"]),
}


def situation(name: str, limits: Limits, phase: Phase, running: tuple, due: bool) -> Life:
    timed = phase in (Phase.DRAINING, Phase.ENDING, Phase.BACKOFF, Phase.STOPPING) or \
        phase == Phase.STARTING and limits.startup_s is not None
    return Life(name, limits, phase, frozenset(running), since=NOW - 10,
                deadline=(NOW if due else NOW + 5) if timed else None)


def spelled(action) -> str:
    if isinstance(action, lc.Notify):
        return f"Notify({action.note})"
    if isinstance(action, lc.Log):
        return f"Log({action.event})"
    if isinstance(action, lc.GiveUp):
        return "GiveUp"
    return type(action).__name__


def outcome(before: Life, after: Life, actions) -> tuple[str, list[str]]:
    phase = KEPT if after.phase == before.phase else after.phase.value
    if before.phase == Phase.STARTING and after.why and after.why.startswith("startup timeout"):
        phase = "startup timeout"
    return phase, [spelled(a) for a in actions]


def table(name: str, limits: Limits) -> dict:
    """{(situation, event): (phase after, actions)} for every pair that does something."""
    found = {}
    for label, phase, running, due in SITUATIONS:
        for event_name, event in EVENTS.items():
            before = situation(name, limits, phase, running, due)
            after, actions = lc.step(before, event, NOW)
            if after != before or actions:
                found[(label, event_name)] = outcome(before, after, actions)
    return found


@pytest.mark.parametrize("kind", KINDS)
def test_every_phase_against_every_event(kind):
    limits = KINDS[kind]
    expected = dict(EXPECTED)
    if limits.startup_s is None:  # the deployment's startup timeout stands for the unit's own
        del expected[("starting", "Timer")]
    assert table(kind, limits) == expected


def test_the_architecture_doc_shows_this_table():
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    block = doc.split("<!-- lifecycle: generated from tests/vsup/test_lifecycle.py -->\n")[1].split("<!-- /")[0]
    assert block.strip().splitlines() == doc_table(), \
        "docs/ARCHITECTURE.md's lifecycle table is stale: print doc_table() of tests/vsup/test_lifecycle.py there"


def doc_table() -> list[str]:
    rows = ["| where it stands | event | next | actions |", "|---|---|---|---|"]
    for (label, event), (phase, actions) in table("vllm r1", KINDS["vllm r1"]).items():
        rows.append(f"| {label} | {event} | {phase} | {', '.join(actions) or '-'} |")
    return rows


# walks through time, with a fake clock

def run(life: Life, *timed_events) -> tuple[Life, list]:
    """Each (now, event) in turn; every action, as (now, action)."""
    seen = []
    for now, event in timed_events:
        life, actions = lc.step(life, event, now)
        seen += [(now, a) for a in actions]
    return life, seen


def crash_and_restart(life: Life, now: float, pid: int) -> tuple[Life, list]:
    """The unit's process `pid` is killed at `now`, and the unit restarts once its backoff is over."""
    life, actions = run(life, (now, lc.Exited(pid, life.name, "signal 9 (SIGKILL)")))
    if life.phase == Phase.BACKOFF:
        life, more = run(life, (life.deadline, lc.Timer()), (life.deadline, lc.Started(pid + 1)),
                         (life.deadline, lc.Ready()))
        actions += more
    return life, actions


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_gives_up_past_max_restarts_naming_the_last_exit(kind):
    life = Life(kind, replace(KINDS[kind], policy=RestartPolicy(max_restarts=2)))
    life, _ = run(life, (0.0, lc.Launch()), (0.0, lc.Started(10)), (0.0, lc.Ready()))
    delays = []
    for pid, now in ((10, 1.0), (11, 3.0)):
        life, actions = crash_and_restart(life, now, pid)
        assert life.phase == Phase.READY
        delays += [dict(a.fields)["delay_s"] for _, a in actions if isinstance(a, lc.Log)]
    assert delays == [0.5, 1.0]
    life, actions = lc.step(life, lc.Exited(12, kind, "signal 9 (SIGKILL)"), 6.0)
    assert life.phase == Phase.FAILED and life.deadline is None and life.restarts.total == 2
    assert [a for a in actions if isinstance(a, lc.GiveUp)] == \
        [lc.GiveUp("2 restarts within 300 s (last exit: signal 9 (SIGKILL))")]
    assert lc.step(life, lc.Timer(), 1e9) == (life, [])  # never again


def test_the_last_exit_names_the_process_when_it_is_not_the_unit():
    life = Life("worker-group dp0", Limits(RestartPolicy(max_restarts=0)), Phase.READY, frozenset({1, 2}))
    life, actions = lc.step(life, lc.Exited(1, "worker dp0 pp0 tp1", "exit 1"), NOW)
    assert actions == [lc.Record(), lc.Kill(), lc.Notify(Note.LOST),
                       lc.GiveUp("0 restarts within 300 s (last exit: worker dp0 pp0 tp1 exit 1)"), lc.Save()]
    stalled = Life("vllm", Limits(RestartPolicy(max_restarts=0)), Phase.READY, frozenset({1}))
    assert lc.GiveUp("0 restarts within 300 s (no token for 120 s)") in \
        lc.step(stalled, lc.Stalled("no token for 120 s"), NOW)[1]


def test_an_exit_0_under_on_failure_gives_up_naming_the_policy():
    life = Life("coordinator", phase=Phase.READY, running=frozenset({5}))
    life, actions = lc.step(life, lc.Exited(5, "coordinator", "exit 0", failure=False), NOW)
    assert life.phase == Phase.FAILED
    assert lc.GiveUp("--restart-policy on-failure (last exit: exit 0)") in actions
    always = replace(Life("coordinator", phase=Phase.READY, running=frozenset({5})),
                     limits=Limits(RestartPolicy("always")))
    assert lc.step(always, lc.Exited(5, "coordinator", "exit 0", failure=False), NOW)[0].phase == Phase.BACKOFF


def test_backoff_doubles_and_resets_after_a_healthy_minute():
    life, _ = run(Life("api-server a0"), (0.0, lc.Launch()), (0.0, lc.Started(1)), (0.0, lc.Ready()))
    delays = []
    for i in range(3):
        life, actions = crash_and_restart(life, life.since + 1.0, 1 + i)
        delays += [dict(a.fields)["delay_s"] for _, a in actions if isinstance(a, lc.Log)]
    assert delays == [0.5, 1.0, 2.0]
    life, actions = crash_and_restart(life, life.since + 61.0, 4)  # a minute of healthy running
    assert [dict(a.fields)["delay_s"] for _, a in actions if isinstance(a, lc.Log)] == [0.5]


def test_restarts_asked_for_start_at_once_and_never_count_toward_the_limit():
    life, _ = run(Life("vllm", Limits(RestartPolicy(max_restarts=0))), (0.0, lc.Launch()), (0.0, lc.Started(1)),
                  (0.0, lc.HealthOk()))
    for i in range(3):
        life, actions = run(life, (1.0, lc.RestartAsked(How.NOW)), (1.0, lc.Exited(1 + i, "vllm", "exit 0")))
        assert life.phase == Phase.STARTING and lc.Spawn() in [a for _, a in actions]
        life, _ = run(life, (1.0, lc.Started(2 + i)), (1.0, lc.HealthOk()))
    assert life.restarts.total == 3 and life.restarts.times == ()


def test_a_drain_then_sigterm_then_sigkill_at_each_deadline():
    limits = Limits(drain_s=30.0, stop_s=10.0)
    life = Life("worker-group dp0", limits, Phase.READY, frozenset({1, 2}))
    life, actions = lc.step(life, lc.RestartAsked(How.DRAIN), 0.0)
    assert life.phase == Phase.DRAINING and life.deadline == 30.0 and lc.Notify(Note.DRAIN) in actions
    assert life.why == "vsup restart"  # what its engine core is told when its workers go
    assert lc.step(life, lc.Timer(), 29.9) == (life, [])  # not yet
    life, actions = lc.step(life, lc.Timer(), 30.0)
    assert life.phase == Phase.ENDING and life.deadline == 40.0 and lc.Signal() in actions
    life, actions = lc.step(life, lc.Timer(), 40.0)
    assert actions == [lc.Kill()] and life.deadline is None
    life, actions = run(life, (40.1, lc.Exited(1, "worker dp0 pp0 tp0", "signal 9 (SIGKILL)")),
                        (40.1, lc.Exited(2, "worker dp0 pp0 tp1", "signal 9 (SIGKILL)")))
    assert life.phase == Phase.STARTING and [a for _, a in actions] == [lc.Save(), lc.Spawn(), lc.Save()]
    assert life.restarts.total == 1 and life.restarts.times == ()


def test_a_vllm_tree_that_never_serves_restarts_at_its_startup_timeout():
    life, _ = run(Life("vllm", Limits(startup_s=60.0)), (0.0, lc.Launch()), (0.0, lc.Started(7)))
    assert life.deadline == 60.0
    life, actions = lc.step(life, lc.Timer(), 60.0)
    assert life.phase == Phase.BACKOFF and life.why == "startup timeout: not ready after 60 s"
    assert actions[:3] == [lc.Record(), lc.Kill(), lc.Notify(Note.LOST)]


def test_a_stop_waits_for_every_process_and_kills_at_its_deadline():
    life = Life("engine-core dp0", phase=Phase.READY, running=frozenset({1, 2, 3}))
    life, actions = lc.step(life, lc.StopAsked(10.0), 0.0)
    assert life.phase == Phase.STOPPING and actions == [lc.Signal(), lc.Save()]
    life, _ = run(life, (1.0, lc.Exited(1, "engine-core dp0", "exit 0")), (1.0, lc.Reaped(2)))
    assert life.phase == Phase.STOPPING and life.running == {3}
    life, actions = lc.step(life, lc.Timer(), 10.0)
    assert actions == [lc.Kill()]
    late, actions = lc.step(life, lc.Started(4), 10.05)  # introduced after the SIGKILL: killed too
    assert actions == [lc.Kill()] and late.running == {3, 4}
    assert lc.step(life, lc.Exited(3, "worker dp0 pp0 tp0", "signal 9 (SIGKILL)"), 10.1)[0].phase == Phase.STOPPED
