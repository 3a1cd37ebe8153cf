"""The step watch (engine/worker/step_watch.py): a step that runs on after its core gave the group up
ends the worker; a step that ends in time, or one whose ring is still open, never does."""

from __future__ import annotations

import threading

from engine.worker import step_watch
from engine.worker.step_watch import StepWatch
from tests.polling import wait_for


class Log:
    def __init__(self):
        self.lines = []

    def warning(self, event, **kw):
        self.lines.append(event)


def watch(abandoned):
    exited, log = threading.Event(), Log()
    return StepWatch(lambda: abandoned.is_set(), log, exit=lambda code: exited.set()), exited, log


def test_a_step_stuck_on_an_abandoned_ring_exits(monkeypatch):
    monkeypatch.setattr(step_watch, "WATCH_S", 0.01)
    monkeypatch.setattr(step_watch, "ABANDONED_S", 0.05)
    abandoned = threading.Event()
    w, exited, log = watch(abandoned)
    with w:
        abandoned.set()
        wait_for(exited.is_set, 5, "the stuck worker exited")
    w.close()
    assert log.lines == ["the engine core gave up this group while a step ran here; exiting"]


def test_no_exit_between_steps_or_while_the_ring_is_open(monkeypatch):
    """Between steps the loop reads the close itself (a clean Shutdown then exits 0): never exit there."""
    monkeypatch.setattr(step_watch, "WATCH_S", 0.01)
    monkeypatch.setattr(step_watch, "ABANDONED_S", 0.05)
    abandoned = threading.Event()
    w, exited, log = watch(abandoned)
    with w:  # a long step on an open ring
        assert not exited.wait(0.3)
    abandoned.set()  # closed between steps
    assert not exited.wait(0.3)
    w.close()
    assert not log.lines and not w.thread.is_alive()


def test_a_closed_ring_ends_the_watch_quietly(monkeypatch):
    """The ring's memory released under the watch (ValueError): the loop is over, nothing to do."""
    monkeypatch.setattr(step_watch, "WATCH_S", 0.01)

    def released():
        raise ValueError("operation forbidden on released memoryview object")
    exited = threading.Event()
    w = StepWatch(released, Log(), exit=lambda code: exited.set())
    with w:
        w.thread.join(timeout=5)
    assert not w.thread.is_alive() and not exited.is_set()
    w.close()
