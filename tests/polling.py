"""Waiting on real processes: poll a condition until it holds."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float = 30.0, what: str = "condition", interval: float = 0.1, now=None):
    """predicate()'s first truthy value, polled every `interval` seconds; TimeoutError(what) after `timeout`,
    with what `now()` says of the state then, if given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what}; now:\n{now()}" if now else what)
