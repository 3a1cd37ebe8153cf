"""Waiting on real processes: poll a condition until it holds."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float = 30.0, what: str = "condition", interval: float = 0.1):
    """predicate()'s first truthy value, polled every `interval` seconds; TimeoutError(what) after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(what)
