"""The --dp-lockstep barrier: while any rank has work, every live rank steps once per go.

Pure logic with an injectable clock, no sockets: the coordinator feeds it
every message a core sends (`heard`, `on_report`) and calls `tick` when
`seconds_to_tick` has passed; each returns the messages to publish.

A wave starts when an idle coordinator hears a report with work. Step s of
wave w: `WaveGo(w, s)` goes out; every rank runs one step (a real one if it
has work, else a dummy) and answers `WaveReport(w, s, has_work)`. When every
rank the barrier waits for has answered, the next go goes out if any of them
has work, else `WaveEnd(w)`.

Whom the barrier waits for: ranks heard (any message: a CoreLoad heartbeat
every second, or a report) within `dead_after_s`, and not left out as deaf.
So a rank that never joined or went silent (dead, or busy regaining its
workers) holds nobody up for more than `dead_after_s`. A rank that is alive
but leaves a go unanswered for `dead_after_s` (it cannot hear the gos, or one
step took that long) is left out as deaf until its next report. While the
barrier waits, the go is published again every `republish_s`: a rank that
(re)joined mid-wave, or lost a message, runs that step then and is in sync;
one that already ran it answers again without stepping.

`epoch` names this coordinator instance; a core that sees a new epoch drops
what it knew of the old one's waves, so a restarted coordinator, whose wave
numbers start again at 0, is never taken for a stale one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import structlog

from engine.wire.protocol import WaveEnd, WaveGo, WaveReport

log = structlog.get_logger("coordinator")
DEAD_AFTER_S = 5.0
REPUBLISH_S = 0.5
STARTUP_GRACE_S = 1.5  # a new coordinator first hears every live core's heartbeat (1 s) before a wave


class WaveBarrier:
    """The state of the waves: idle, or waiting for every live rank's report of one step."""

    def __init__(self, ranks: Iterable[int], epoch: str, *, dead_after_s: float = DEAD_AFTER_S,
                 republish_s: float = REPUBLISH_S, startup_grace_s: float = STARTUP_GRACE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.ranks = set(ranks)
        self.epoch = epoch
        self.dead_after_s, self.republish_s = dead_after_s, republish_s
        self.clock = clock
        self.born = clock()
        self.startup_grace_s = startup_grace_s
        self.last_heard: dict[int, float] = {}
        self.deaf: set[int] = set()
        self.silent: set[int] = set()    # ranks once heard, not now (logged once)
        self.running = False
        self.wave = 0        # the running wave, or the next one when idle
        self.step = 0
        self.done: dict[int, bool] = {}   # rank -> has_work, for this step
        self.step_started = 0.0           # when this step's first go went out
        self.published_at = 0.0
        self.wanted = False               # a rank has work, the wave waits out the startup grace
        self.num_waves = self.num_steps = 0

    # what the cores say

    def heard(self, rank: int) -> None:
        """Any message from a core shows it alive."""
        self.ranks.add(rank)
        self.last_heard[rank] = self.clock()
        if rank in self.silent:
            self.silent.discard(rank)
            log.info("rank heard again; in the barrier from the next go", dp_rank=rank)

    def on_report(self, report: WaveReport) -> list[WaveGo | WaveEnd]:
        rank = report.dp_rank
        self.heard(rank)
        if rank in self.deaf:
            log.info("rank answers again; back in the barrier", dp_rank=rank)
            self.deaf.discard(rank)
        if not self.running:
            if report.has_work:
                self.wanted = True
            return self._maybe_start()
        if (report.epoch, report.wave, report.step) == (self.epoch, self.wave, self.step):
            self.done[rank] = report.has_work  # the latest wins: new work after "none" says so again
            return self._maybe_advance()
        # a stale report, or a wake from a rank that has not seen this step's go: the republished
        # go brings it in, and the barrier now waits for it (it is heard)
        return []

    def tick(self) -> list[WaveGo | WaveEnd]:
        """Leave out ranks gone silent or deaf, publish the go again, start a wave that waited."""
        now = self.clock()
        for rank in sorted(self.last_heard.keys() - self.live() - self.silent):
            log.warning("rank silent; the barrier goes on without it", dp_rank=rank,
                        seconds=round(now - self.last_heard[rank], 2))
            self.silent.add(rank)
        if not self.running:
            return self._maybe_start()
        if now - self.step_started >= self.dead_after_s:
            for rank in sorted(self.waited() - self.done.keys()):
                log.warning("rank did not answer a go; leaving it out of the barrier until it does",
                            dp_rank=rank, wave=self.wave, step=self.step,
                            seconds=round(now - self.step_started, 2))
                self.deaf.add(rank)
        out = self._maybe_advance()
        if not out and self.running and now - self.published_at >= self.republish_s:
            out = [self._go()]
        return out

    def seconds_to_tick(self) -> float:
        """How long the coordinator may block before `tick` has something to do."""
        now = self.clock()
        if not self.running:
            return max(0.0, self.born + self.startup_grace_s - now) if self.wanted else self.dead_after_s
        waits = [self.published_at + self.republish_s, self.step_started + self.dead_after_s]
        waits += [self.last_heard[r] + self.dead_after_s for r in self.waited() - self.done.keys()]
        return max(0.0, min(waits) - now)

    # questions

    def live(self) -> set[int]:
        now = self.clock()
        return {r for r, t in self.last_heard.items() if now - t <= self.dead_after_s}

    def waited(self) -> set[int]:
        """The ranks this step's barrier waits for."""
        return self.live() - self.deaf

    # transitions

    def _maybe_start(self) -> list[WaveGo | WaveEnd]:
        if not self.wanted:
            return []
        if self.clock() - self.born < self.startup_grace_s and not self.ranks <= self.live():
            return []  # a restarted coordinator: let every live core's heartbeat come in first
        self.wanted, self.running, self.step, self.done = False, True, 0, {}
        self.num_waves += 1
        self.step_started = self.clock()
        return [self._go()]

    def _maybe_advance(self) -> list[WaveGo | WaveEnd]:
        waited = self.waited()
        if not waited <= self.done.keys():
            return []
        self.num_steps += 1
        if any(self.done[r] for r in waited):
            self.step, self.done, self.step_started = self.step + 1, {}, self.clock()
            return [self._go()]
        end = WaveEnd(self.epoch, self.wave)
        self.running, self.wave, self.done = False, self.wave + 1, {}
        return [end]

    def _go(self) -> WaveGo:
        self.published_at = self.clock()
        return WaveGo(self.epoch, self.wave, self.step, sorted(self.waited()))
