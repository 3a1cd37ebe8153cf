"""Waiting on real processes: poll a condition until it holds.

Many conditions are asked of a new process (`vsup ps --json`: 0.16 s of a core, longer on a busy
machine), and a wait may last minutes (a vLLM tree starting). Polled every 0.1-0.2 s, such a wait took
about 40% of a core from the very processes it waited for; so the pause after each try is at least twice
what the try took, and it grows with the wait (to 1 s after 20 s), which costs a long wait at most 5% more.
"""

from __future__ import annotations

import time

MAX_PAUSE_S = 1.0


def pause(interval: float, tried_s: float, waited_s: float) -> float:
    """The pause before the next try: `interval`, at least twice the last try, longer as the wait goes on."""
    return max(interval, 2 * tried_s, min(MAX_PAUSE_S, waited_s / 20))


def wait_for(predicate, timeout: float = 30.0, what: str = "condition", interval: float = 0.1, now=None):
    """predicate()'s first truthy value, polled every `interval` seconds or more (`pause`); TimeoutError(what)
    after `timeout`, with what `now()` says of the state then, if given."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        tried = time.monotonic()
        value = predicate()
        if value:
            return value
        done = time.monotonic()
        if done >= deadline:
            break
        time.sleep(min(deadline - done, pause(interval, done - tried, done - start)))
    raise TimeoutError(f"{what}; now:\n{now()}" if now else what)
