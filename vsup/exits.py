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


def returncode_of(exit: str | None) -> int | None:
    """describe_exit's inverse: `exit 1` -> 1, `signal 9 (SIGKILL)` -> -9; None for anything else."""
    words = (exit or "").split()
    if len(words) >= 2 and words[0] in ("exit", "signal") and words[1].lstrip("-").isdigit():
        return int(words[1]) * (-1 if words[0] == "signal" else 1)
    return None
