"""A worker's way out of a step that its group abandoned.

A step can block inside a collective whose peer died without the transport
noticing: gloo then waits out its whole timeout (two minutes), and since the
worker is inside C++ it hears neither the ring nor SIGTERM. Its core has
long since lost the group and waits for a new one, which this rank, alive
and stuck (and, as rank 0, hosting the rendezvous store), holds up.

So a thread beside the step loop watches the ring: once the core has closed
it (it lost the group) or died, and the step still runs ABANDONED_S later,
nothing this process computes can matter. It exits 1 at once, and its
supervisor starts a worker that joins the next generation of the group.
A step that ends in time goes back to the ring and reads the close itself.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

WATCH_S = 0.5
ABANDONED_S = 2.0


class StepWatch:
    """`with watch: ...` around each step; `abandoned()` says whether the ring's writer closed it
    or died (it may raise ValueError once the ring is closed here)."""

    def __init__(self, abandoned: Callable[[], bool], log, exit: Callable[[int], None] = os._exit):
        self.abandoned, self.log, self.exit = abandoned, log, exit
        self.started: float | None = None  # when the running step began; None between steps
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="step-watch", daemon=True)
        self.thread.start()

    def __enter__(self) -> None:
        self.started = time.monotonic()

    def __exit__(self, *exc) -> None:
        self.started = None

    def close(self) -> None:
        """Stop watching (before the ring is closed here)."""
        self.done.set()
        self.thread.join()

    def _watch(self) -> None:
        since = None  # when a step was first seen running on an abandoned ring
        while not self.done.wait(WATCH_S):
            started = self.started
            try:
                stuck = started is not None and self.abandoned()
            except ValueError:  # closed here meanwhile: the loop is over
                return
            if not stuck:
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since >= ABANDONED_S:
                self.log.warning("the engine core gave up this group while a step ran here; exiting",
                                 step_seconds=round(time.monotonic() - started, 1))
                sys.stdout.flush()
                sys.stderr.flush()
                self.exit(1)
                return
