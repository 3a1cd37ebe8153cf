"""The core's half of --dp-lockstep: which step of the coordinator's waves to run, and what to report.

Pure logic with an injectable clock, no sockets, beside the coordinator's
`WaveBarrier` (engine/coordinator/waves.py). The core feeds it every wave
message (`on_wave`), asks it for the go to run (`take_go`), tells it the step
ran (`stepped`), and each time round its loop asks whether to report
(`wants_report`); every report it sends goes through `report`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from engine.wire.protocol import WaveEnd, WaveGo, WaveReport

log = structlog.get_logger("engine-core")
WAVE_RESYNC_S = 2.0  # with work and no go for this long, ask the coordinator again


class WaveFollower:
    """What one DP rank knows of the waves: the coordinator instance it follows, the step it last ran,
    the go it should run now."""

    def __init__(self, dp_rank: int, *, resync_s: float = WAVE_RESYNC_S, clock: Callable[[], float] = time.monotonic):
        self.dp_rank = dp_rank
        self.resync_s, self.clock = resync_s, clock
        self.epoch = ""                           # the coordinator instance whose waves we follow
        self.done: tuple[int, int] | None = None  # (wave, step) we last ran in that epoch
        self.go: tuple[int, int] | None = None    # (wave, step) the coordinator says to run now
        self.in_wave = False
        self.reported_work = False                # what our last report said
        self.last_report = 0.0

    def on_wave(self, msg: WaveGo | WaveEnd) -> bool:
        """Take one message of the coordinator's; True when it asks us to report again (a go published
        again for the step we ran: our report may have been lost)."""
        if msg.epoch != self.epoch:
            if self.epoch:
                log.info("a new coordinator runs the waves; following it", epoch=msg.epoch)
            self.epoch, self.done, self.go = msg.epoch, None, None
        if isinstance(msg, WaveEnd):
            if self.done is None or msg.wave >= self.done[0]:
                self.in_wave = False
            if self.go is not None and self.go[0] <= msg.wave:
                self.go = None  # a go of a wave that ended without us: running it would step alone
            return False
        self.in_wave = True
        at = (msg.wave, msg.step)
        if self.done is not None and at <= self.done:
            return at == self.done and self.go is None
        self.go = at  # the newest go wins: a rank that fell behind syncs to it
        return False

    def take_go(self) -> tuple[int, int] | None:
        """The step to run now (once), or None."""
        go, self.go = self.go, None
        return go

    def stepped(self, at: tuple[int, int]) -> None:
        """We ran step `at` (a real step, or a dummy one)."""
        self.done = at

    def wants_report(self, has_work: bool) -> bool:
        """With work and no go: ask for a wave, and again when no go came for `resync_s`."""
        if not has_work or self.go is not None:
            return False
        waited = self.clock() - self.last_report
        if self.reported_work and waited >= self.resync_s:
            log.warning("no go from the coordinator; asking again", waited_s=round(waited, 2), epoch=self.epoch,
                        last_step=self.done)
        return not self.reported_work or waited >= self.resync_s

    def report(self, has_work: bool) -> WaveReport:
        """The report to send now: the step we last ran, and whether we have work."""
        wave, step = self.done if self.done is not None else (-1, -1)
        self.reported_work, self.last_report = has_work, self.clock()
        return WaveReport(self.dp_rank, self.epoch, wave, step, has_work)
