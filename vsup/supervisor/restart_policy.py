"""When a unit may start again: exponential backoff and a start limit. Pure; time comes in as numbers.

`decide` is the one place where vsup decides to restart a unit, back off, or give up: every kind of unit
of both engines comes through it (vsup/supervisor/lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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


@dataclass(frozen=True)
class Restarts:
    """One unit's history: when it restarted after a failure (within the window), the backoff it is
    at, and every restart in all (those asked for too)."""

    times: tuple[float, ...] = ()
    backoff_s: float = 0.0
    total: int = 0

    def asked(self) -> Restarts:
        """A restart asked for (`vsup restart`): it starts at once and counts only in the total."""
        return replace(self, total=self.total + 1)


@dataclass(frozen=True)
class Decision:
    """What follows an exit that nobody asked for: `delay` seconds until the next start, or none
    (`why_not` says why: the policy, or the start limit)."""

    restarts: Restarts
    delay: float | None
    why_not: str | None = None


def decide(policy: RestartPolicy, restarts: Restarts, now: float, started_at: float, failure: bool) -> Decision:
    """Restart, back off, or give up, for a unit that ran since `started_at` and ended at `now` (`failure`:
    whether the exit counts as one: a non-zero exit or a signal; with vLLM, any exit vsup did not ask for)."""
    if policy.policy == "never" or (policy.policy == "on-failure" and not failure):
        return Decision(restarts, None, f"--restart-policy {policy.policy}")
    backoff = 0.0 if now - started_at >= policy.reset_after_s else restarts.backoff_s  # it ran long enough
    times = tuple(t for t in restarts.times if now - t <= policy.window_s)
    if len(times) >= policy.max_restarts:
        return Decision(replace(restarts, times=times), None,
                        f"{policy.max_restarts} restarts within {policy.window_s:g} s")
    backoff = policy.initial_s if backoff == 0 else min(backoff * 2, policy.max_s)
    return Decision(Restarts(times + (now,), backoff, restarts.total + 1), backoff)
