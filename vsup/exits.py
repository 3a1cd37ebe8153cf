"""How a process ended, spelled one way for ps, logs and messages."""

from __future__ import annotations

import signal


def describe_exit(returncode: int) -> str:
    """`exit 1`, `signal 9 (SIGKILL)`: how a process ended, from its return code (negative: a signal)."""
    if returncode < 0:
        try:
            return f"signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"
