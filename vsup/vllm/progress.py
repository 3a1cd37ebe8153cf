"""When an engine that still runs has stopped serving. Pure.

vLLM can hang with /health at 200 (its issues #39863, #11996), so health alone
is not enough: requests that wait while no token comes out are a hang too.
Our own engine's cores are watched the same way, by their steps
(vsup/supervisor/engine_units.py).
"""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^vllm:(num_requests_running|num_requests_waiting|generation_tokens_total)\{[^}]*\} (\S+)$",
                     re.M)


def parse_metrics(text: str) -> tuple[float, float] | None:
    """(requests running + waiting, tokens generated) summed over the engines of vLLM's /metrics."""
    busy = generated = 0.0
    seen = False
    for name, value in _SAMPLE.findall(text):
        seen = True
        if name == "generation_tokens_total":
            generated += float(value)
        else:
            busy += float(value)
    return (busy, generated) if seen else None


class Progress:
    """Fed one probe a second; says why the tree must restart, or None."""

    def __init__(self, health_timeout: float, hang_timeout: float, now: float):
        self.health_timeout, self.hang_timeout = health_timeout, hang_timeout
        self.healthy_at = self.moving_at = now
        self.generated: float | None = None

    def update(self, now: float, healthy: bool, metrics: tuple[float, float] | None) -> str | None:
        if healthy:
            self.healthy_at = now
        elif now - self.healthy_at > self.health_timeout:
            return f"/health has failed for {now - self.healthy_at:.0f} s (--health-timeout {self.health_timeout:g})"
        if metrics is None:
            return None
        busy, generated = metrics
        if not busy or generated != self.generated:
            self.generated, self.moving_at = generated, now
            return None
        if now - self.moving_at > self.hang_timeout:
            return (f"hung: {busy:.0f} requests running or waiting and no token for {now - self.moving_at:.0f} s "
                    f"(--hang-timeout {self.hang_timeout:g})")
        return None
