"""What an API server knows of each data-parallel rank, and where the next request goes.

Pure logic with an injectable clock: the engine client feeds it the cores'
Hello / Ready / Failed messages and its own request counts; it answers
which rank is least loaded, which ranks are up, and when a rank was replaced.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

UNKNOWN, STARTING, READY, FAILED = "unknown", "starting", "ready", "failed"


class EngineUnavailable(RuntimeError):
    """No data-parallel rank can take a request now (starting, or all down)."""


@dataclass
class RankState:
    """One DP rank as this API server sees it."""

    dp_rank: int
    state: str = UNKNOWN
    instance: str | None = None
    pid: int | None = None
    node: str = ""                    # the host the core runs on, from its Hello
    was_ready: bool = False           # ready at least once: a restart is a blip, not a start
    last_heard: float | None = None
    error: str | None = None
    max_model_len: int | None = None
    num_in_flight: int = 0            # this API server's unfinished requests on the rank
    external_load: int | None = None  # requests from all API servers, when a coordinator says
    num_restarts: int = 0
    counters: tuple[int, int, int] | None = None  # the core's [steps, dummy steps, requests], from the coordinator
    draining: bool = False            # finishing what runs before a restart: the last choice


class DpRanks:
    """The DP ranks' states and least-loaded routing.

    A rank is routable once Ready, and stays routable while a replacement
    core starts (its requests wait there rather than fail); it is "up" for
    /health while Ready and heard within `heartbeat_timeout_s`. A rank that
    says Failed is routed around until a new instance says Hello.
    """

    def __init__(self, size: int, heartbeat_timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        if size < 1:
            raise ValueError(f"data parallel size must be >= 1, got {size}")
        self.ranks = {r: RankState(r) for r in range(size)}
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock

    def get(self, dp_rank: int) -> RankState:
        """The rank's state; a rank beyond --data-parallel-size is added (and served) too."""
        if dp_rank not in self.ranks:
            self.ranks[dp_rank] = RankState(dp_rank)
        return self.ranks[dp_rank]

    # what the cores say

    def on_hello(self, dp_rank: int, instance: str, pid: int | None = None, node: str = "") -> bool:
        """A core (re)started; True when it replaces an instance this API server knew."""
        rank = self.get(dp_rank)
        replaced = rank.instance is not None and rank.instance != instance
        if rank.instance != instance:
            rank.state, rank.error, rank.draining = STARTING, None, False
            rank.num_restarts += replaced
        rank.instance, rank.pid = instance, pid if pid is not None else rank.pid
        rank.node = node or rank.node
        self.heard(dp_rank)
        return replaced

    def on_ready(self, dp_rank: int, max_model_len: int, draining: bool = False) -> bool:
        """A Ready or heartbeat of the rank's current instance; True when it just became ready."""
        rank = self.get(dp_rank)
        became_ready = rank.state != READY
        rank.state, rank.was_ready, rank.error, rank.max_model_len = READY, True, None, max_model_len
        rank.draining = draining
        self.heard(dp_rank)
        return became_ready

    def on_failed(self, dp_rank: int, error: str) -> None:
        """The rank cannot serve; routed around until a new instance says Hello."""
        rank = self.get(dp_rank)
        rank.state, rank.error = FAILED, error
        self.heard(dp_rank)

    def heard(self, dp_rank: int) -> None:
        """Any message from the rank shows it alive."""
        self.get(dp_rank).last_heard = self.clock()

    def set_external_load(self, dp_rank: int, num_requests: int | None) -> None:
        """The hook for a coordinator's load stats (all API servers' requests on the rank)."""
        self.get(dp_rank).external_load = num_requests

    # questions

    def is_routable(self, dp_rank: int) -> bool:
        """Whether a request may go to the rank now (it may wait there for a replacement core)."""
        rank = self.get(dp_rank)
        return rank.state == READY or (rank.state == STARTING and rank.was_ready)

    def is_up(self, dp_rank: int) -> bool:
        """Ready and heard from within the heartbeat timeout."""
        rank = self.get(dp_rank)
        return rank.state == READY and self._is_fresh(rank)

    def is_fresh(self, dp_rank: int) -> bool:
        """Heard from within the heartbeat timeout."""
        return self._is_fresh(self.get(dp_rank))

    def seconds_since_heard(self, dp_rank: int) -> float | None:
        heard = self.get(dp_rank).last_heard
        return None if heard is None else round(self.clock() - heard, 3)

    def _is_fresh(self, rank: RankState) -> bool:
        return rank.last_heard is not None and self.clock() - rank.last_heard <= self.heartbeat_timeout_s

    def choose(self, exclude: frozenset[int] = frozenset(), fresh_only: bool = False) -> int:
        """The least-loaded routable rank, preferring ranks heard from lately (with `fresh_only`, only
        those) and ranks not draining; raises EngineUnavailable."""
        candidates = [r for r in self.ranks.values() if r.dp_rank not in exclude and self.is_routable(r.dp_rank)
                      and (self._is_fresh(r) or not fresh_only)]
        if not candidates:
            raise EngineUnavailable(self.why_unavailable())
        best = min(candidates, key=lambda r: (not self._is_fresh(r), r.state != READY, r.draining, self.load(r),
                                              r.dp_rank))
        return best.dp_rank

    def load(self, rank: RankState) -> int:
        """The rank's load: the coordinator's count when known, plus ours (ours is never stale)."""
        return rank.num_in_flight + (rank.external_load or 0)

    def max_model_len(self) -> int | None:
        """The context length the ready cores serve (the smallest, should they differ)."""
        lens = [r.max_model_len for r in self.ranks.values() if r.max_model_len and r.was_ready]
        return min(lens) if lens else None

    def why_unavailable(self) -> str:
        """The 503 message: which ranks failed and why, or that none is ready yet."""
        failed = [f"dp{r.dp_rank}: {r.error}" for r in self.ranks.values() if r.state == FAILED]
        if failed:
            return "no engine core is up (" + "; ".join(failed) + ")"
        return "no engine core is ready yet; retry shortly"

    def summary(self) -> dict:
        """For /health: each rank's state, and which are up, down, failed."""
        now = self.clock()
        ranks = {}
        for r in sorted(self.ranks.values(), key=lambda r: r.dp_rank):
            ranks[str(r.dp_rank)] = {
                "state": r.state if r.state != READY or self._is_fresh(r) else "unresponsive",
                "pid": r.pid, "node": r.node or None, "num_in_flight": r.num_in_flight,
                "num_restarts": r.num_restarts, **({"draining": True} if r.draining else {}),
                "seconds_since_heard": None if r.last_heard is None else round(now - r.last_heard, 3),
                **({"error": r.error} if r.error else {}),
            }
        up = [r for r in self.ranks if self.is_up(r)]
        failed = [r for r, s in self.ranks.items() if s.state == FAILED]
        down = [r for r in self.ranks if r not in up and r not in failed]
        status = ("ok" if not down and not failed else "degraded") if up else (
            "unavailable" if failed or any(s.was_ready for s in self.ranks.values()) else "starting")
        names = [f"dp{r} {'failed' if r in failed else 'down'}" for r in sorted([*down, *failed])]
        return {"status": status, "up": sorted(up), "down": sorted(down), "failed": sorted(failed),
                **({"message": ", ".join(names)} if names else {}), "dp_ranks": ranks}
