"""Which vLLM tree a request goes to: what the supervisor last said of each tree (one per replica), and
the least loaded tree that is up and not one the request died on, holding the request while there is
none (--resume-timeout, --max-pending).

The supervisor tells the front of each tree on its stdin (messages.TreeNews), one line per tree and
change. Gens are unique across replicas: a request remembers the gens it died on, and never goes back
to one.
"""

from __future__ import annotations

import asyncio
import time

from vsup.front.errors import Refused
from vsup.messages import TreeNews

GRACE_S = 5.0  # how long a tree that failed a request may still say it is up before the failure is the request's


class Trees:
    """What the supervisor last said of each vLLM tree behind the front (one per replica)."""

    def __init__(self, replicas: int):
        self.gens, self.ups = [0] * replicas, [False] * replicas
        self.stopping, self.restarts, self.incidents = False, {}, {}
        self._changed = asyncio.Event()

    def update(self, news: TreeNews) -> None:
        r = news.replica
        if not 0 <= r < len(self.gens):
            raise ValueError(f"replica {r}")
        self.gens[r], self.ups[r], self.stopping, self.restarts = news.gen, news.up, news.stopping, news.restarts
        self.incidents = news.incidents
        self._changed.set()
        self._changed = asyncio.Event()

    def up(self, avoid: set[int] = frozenset()) -> list[int]:
        """The replicas up now, but not those whose tree is one of the gens `avoid`."""
        return [r for r, (gen, up) in enumerate(zip(self.gens, self.ups)) if up and gen not in avoid]

    def lives(self, gen: int) -> bool:
        """Whether tree `gen` is still the one up on its replica."""
        return any(g == gen and up for g, up in zip(self.gens, self.ups))

    async def changed(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), max(0.0, timeout))
        except asyncio.TimeoutError:
            pass



class Router:
    def __init__(self, replicas: int, resume_timeout: float, max_pending: int):
        self.trees = Trees(replicas)
        self.resume_timeout, self.max_pending = resume_timeout, max_pending
        self.bound: dict[int, int] = {}  # generation id -> the gen of the tree it runs on (the load of each)
        self.turn = 0  # (among replicas as loaded: round robin)
        self.pending = 0  # requests waiting for a tree

    async def tree_after(self, avoid: set[int]) -> tuple[int, int]:
        """(replica, gen) of a tree that is up and none of the gens `avoid` (those that died under the
        request), the least loaded; holding the request until there is one."""
        trees = self.trees
        if not trees.up(avoid):
            if trees.stopping:
                raise Refused(503, "vsup is stopping this deployment")
            if self.pending >= self.max_pending:
                raise Refused(503, f"{self.pending} requests already wait for vLLM to come back (--max-pending "
                                   f"{self.max_pending}); retry later", retry_after=5)
            self.pending += 1
            deadline = time.monotonic() + self.resume_timeout
            try:
                while not trees.up(avoid):
                    if trees.stopping:
                        raise Refused(503, "vsup is stopping this deployment")
                    if time.monotonic() >= deadline:
                        raise Refused(503, f"vLLM did not come back within --resume-timeout "
                                           f"{self.resume_timeout:g} s", retry_after=5)
                    await trees.changed(deadline - time.monotonic())
            finally:
                self.pending -= 1
        up = trees.up(avoid)
        self.turn += 1
        load = {gen: 0 for gen in trees.gens}
        for gen in self.bound.values():
            load[gen] = load.get(gen, 0) + 1
        r = min(up, key=lambda r: (load[trees.gens[r]], (r - self.turn) % len(trees.gens)))
        return r, trees.gens[r]

    async def tree_died(self, gen: int) -> bool:
        """After a request failed on tree `gen`: whether that tree died (False: it lives, the failure was
        the request's own)."""
        deadline = time.monotonic() + GRACE_S
        while self.trees.lives(gen) and time.monotonic() < deadline:
            await self.trees.changed(deadline - time.monotonic())
        return not self.trees.lives(gen)
