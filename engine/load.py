"""What a process of the tree is busy with, for `vsup ps`: the share of wall time spent in each kind of
work (steps, forward passes, tokenizing), rates of events (waves) and gauges (running, waiting, KV use).

Every process keeps one `LoadMeter`. Under a supervisor, a daemon thread
logs it every REPORT_S as one record, event "load" of the logger LOGGER,
which the supervisor keeps for `ps` instead of writing it to the logs. The
meter itself is pure bookkeeping with an injectable clock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import structlog

REPORT_S = 2.0
LOGGER = "vsup.load"


class LoadMeter:
    """Busy seconds by kind (work under way counts up to now), event counts, and the latest gauges,
    all since the last `take`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.lock = threading.Lock()
        self.window_start = clock()
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.under_way: dict[int, tuple[str, float]] = {}  # token -> (kind, since)
        self.gauges: dict[str, float | int | None] = {}
        self.next_token = 0

    @contextlib.contextmanager
    def busy(self, kind: str) -> Iterator[None]:
        """Count the time inside the block as `kind` (from any thread; overlaps add up)."""
        token = self.start(kind)
        try:
            yield
        finally:
            self.stop(token)

    def start(self, kind: str) -> int:
        """`kind` is under way from now until `stop(token)`."""
        with self.lock:
            token, self.next_token = self.next_token, self.next_token + 1
            self.under_way[token] = (kind, self.clock())
            return token

    def stop(self, token: int) -> None:
        with self.lock:
            kind, since = self.under_way.pop(token)
            self.seconds[kind] = self.seconds.get(kind, 0.0) + self.clock() - since

    def add(self, kind: str, seconds: float) -> None:
        """`seconds` of `kind` measured elsewhere."""
        with self.lock:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def count(self, kind: str, n: int = 1) -> None:
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + n

    def set(self, **gauges) -> None:
        with self.lock:
            self.gauges.update(gauges)

    def take(self) -> dict:
        """{"window_s", "busy": {kind: share of the window}, "rates": {kind: per second}, **gauges}; starts
        the next window (work under way goes on counting in it)."""
        with self.lock:
            now = self.clock()
            window = max(now - self.window_start, 1e-9)
            seconds = dict(self.seconds)
            for token, (kind, since) in self.under_way.items():
                seconds[kind] = seconds.get(kind, 0.0) + now - max(since, self.window_start)
                self.under_way[token] = (kind, now)
            report = {"window_s": round(window, 3),
                      "busy": {k: round(min(1.0, s / window), 4) for k, s in sorted(seconds.items())},
                      "rates": {k: round(n / window, 3) for k, n in sorted(self.counts.items())},
                      **self.gauges}
            self.window_start, self.seconds, self.counts = now, {}, {}
            return report


def measure_event_loop(meter: LoadMeter, loop) -> bool:
    """Count an asyncio selector loop's time outside its select() as "loop": the share of wall time its
    one thread is running callbacks (or waiting for the GIL to run them). False for a loop without a
    selector to time (uvloop)."""
    selector = getattr(loop, "_selector", None)
    if selector is None:
        return False
    select = selector.select
    token = [meter.start("loop")]

    def timed_select(timeout=None):
        meter.stop(token[0])
        try:
            return select(timeout)
        finally:
            token[0] = meter.start("loop")

    selector.select = timed_select
    return True


def report_to_supervisor(meter: LoadMeter, extra: Callable[[], dict] | None = None,
                         interval_s: float = REPORT_S) -> threading.Thread | None:
    """Under a supervisor (VSUP_SUPERVISOR_PID), log the meter every `interval_s` from a daemon thread;
    `extra()` adds figures read at that moment. Returns the thread, or None without a supervisor."""
    if not os.environ.get("VSUP_SUPERVISOR_PID"):
        return None
    logging.getLogger(LOGGER).setLevel(logging.INFO)  # whatever --log-level says: ps needs it
    log = structlog.get_logger(LOGGER)

    def run() -> None:
        while True:
            time.sleep(interval_s)
            try:
                log.info("load", **meter.take(), **(extra() if extra else {}))
            except Exception:  # noqa: BLE001 - a figure that fails to read must not end the reports
                log.info("load", **meter.take())

    thread = threading.Thread(target=run, name="load-report", daemon=True)
    thread.start()
    return thread
