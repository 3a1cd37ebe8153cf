"""When a unit may start again: exponential backoff and a start limit. Pure; time comes in as numbers."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

POLICIES = ("always", "on-failure", "never")


@dataclass
class RestartPolicy:
    """Backoff starts at `initial_s`, doubles to `max_s`, and resets after `reset_after_s`
    of healthy running; more than `max_restarts` restarts within `window_s` fail the unit."""

    policy: str = "on-failure"
    initial_s: float = 0.5
    max_s: float = 30.0
    reset_after_s: float = 60.0
    max_restarts: int = 5
    window_s: float = 300.0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"--restart-policy must be one of {', '.join(POLICIES)} (got {self.policy!r})")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be at least 0 (got {self.max_restarts})")
        if not self.max_s > 0:
            raise ValueError(f"--restart-max-delay must be more than 0 seconds (got {self.max_s:g})")
        self.initial_s = min(self.initial_s, self.max_s)


@dataclass
class RestartState:
    """One unit's history: when it restarted, and the backoff it is at."""

    policy: RestartPolicy
    restarts: deque[float] = field(default_factory=deque)
    backoff_s: float = 0.0
    total: int = 0

    def wants_restart(self, exit_code: int | None, requested: bool = False) -> bool:
        """Whether the policy restarts a unit that exited with `exit_code` (None: killed by a signal)."""
        if requested:
            return True
        if self.policy.policy == "never":
            return False
        return self.policy.policy == "always" or exit_code != 0

    def next_delay(self, now: float, started_at: float, requested: bool = False) -> float | None:
        """Seconds to wait before the next start, or None when the start limit is reached. A restart asked
        for (`vsup restart`) starts at once and counts only in the total, never toward the limit."""
        if requested:
            self.total += 1
            return 0.0
        if now - started_at >= self.policy.reset_after_s:
            self.backoff_s = 0.0  # it ran healthily for long enough: start over
        while self.restarts and now - self.restarts[0] > self.policy.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.policy.max_restarts:
            return None
        self.backoff_s = self.policy.initial_s if self.backoff_s == 0 else min(self.backoff_s * 2, self.policy.max_s)
        self.restarts.append(now)
        self.total += 1
        return self.backoff_s
