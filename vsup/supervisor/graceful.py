"""`vsup restart` without --now: each unit drains before it restarts, so that a planned restart drops
nothing.

- An API server: SIGTERM; it stops taking connections and finishes its open
  requests within --drain-timeout, exits 0 and starts again at once. With
  several, one at a time: the next drains only once every API server is ready
  again, so the others serve throughout.
- An engine core or a worker group: the core is told to drain (it finishes
  the running requests and starts no new one) and says "drained"; then the
  core, or its workers, get SIGTERM and restart. What waited goes on after:
  the API servers resubmit what a restarted core held, a core requeues what
  its lost workers held.

A drain that overruns --drain-timeout goes on anyway (the crash path loses no
request either), and a process that does not exit --stop-timeout after its
SIGTERM gets SIGKILL.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from enum import StrEnum

from vsup.supervisor.states import ProcessState, UnitState
from vsup.supervisor.units import UnitId, UnitKind
from vsup.topology import API_SERVER, ENGINE_CORE, process_name


class Phase(StrEnum):
    DRAINING = "draining"  # the core finishes its running requests
    ENDING = "ending"      # SIGTERM sent: the unit's processes exit by themselves


class GracefulRestarts:
    """The drains under way, and the API servers waiting for their turn."""

    def __init__(self, supervisor):
        self.sup = supervisor
        self.waiting: deque[UnitId] = deque()  # API servers, drained one at a time
        self.drained: deque[str] = deque()     # cores that said "drained" (from the log router's thread)

    def request(self, chosen: list[UnitId]) -> None:
        for unit_id in chosen:
            unit = self.sup.units[unit_id]
            if unit_id.kind == UnitKind.ALONE and unit.children[0].spec.role == API_SERVER:
                if unit_id not in self.waiting:
                    self.waiting.append(unit_id)
            elif unit_id.kind in (UnitKind.ENGINE_CORE, UnitKind.WORKER_GROUP):
                self.drain(unit)
            else:  # the coordinator holds no request: it ends cleanly, and restarts
                self.end(unit)
        self.next_api_server()

    def next_api_server(self) -> None:
        """Drain the next waiting API server, once no other is draining or starting."""
        servers = [u for u in self.sup.units.values()
                   if u.id.kind == UnitKind.ALONE and u.children[0].spec.role == API_SERVER]
        if any(u.phase is not None or u.state != UnitState.RUNNING for u in servers) or \
                any(c.state != ProcessState.READY for u in servers for c in u.children):
            return
        while self.waiting:
            unit = self.sup.units[self.waiting.popleft()]
            if unit.children[0].alive:
                self.end(unit, self.sup.options.drain_timeout)  # it drains itself on SIGTERM
                return

    def drain(self, unit) -> None:
        """Tell the unit's core to finish what runs; its "drained" (or --drain-timeout) ends the unit."""
        if unit.phase is not None:
            return
        unit.requested = True
        if not self.sup.notifier.drain(unit.id.dp):
            self.end(unit)  # the core is not there to drain: nothing runs on it
            return
        unit.phase, unit.phase_until = Phase.DRAINING, time.monotonic() + self.sup.options.drain_timeout
        self.sup.log("draining", process=str(unit.id))

    def end(self, unit, grace_s: float = 0.0) -> None:
        """SIGTERM to the unit's processes; SIGKILL after `grace_s` + --stop-timeout."""
        unit.requested = True
        unit.phase, unit.phase_until = Phase.ENDING, time.monotonic() + grace_s + self.sup.options.stop_timeout
        self.sup.log("restarting gracefully", process=str(unit.id))
        for child in unit.children:
            child.signal(signal.SIGTERM)

    def tick(self) -> None:
        """Act on the cores that said "drained", and on drains and ends that overran."""
        while self.drained:
            name = self.drained.popleft()
            for unit in self.sup.units.values():
                if unit.phase == Phase.DRAINING and process_name(ENGINE_CORE, dp=unit.id.dp) == name:
                    self.end(unit)
        now = time.monotonic()
        for unit in self.sup.units.values():
            if unit.phase == Phase.DRAINING and now >= unit.phase_until:
                self.sup.log("drain overran --drain-timeout; restarting anyway", "warning", process=str(unit.id))
                self.end(unit)
            elif unit.phase == Phase.ENDING and now >= unit.phase_until:
                for child in unit.children:
                    child.signal(signal.SIGKILL)
                unit.phase_until = float("inf")  # (its exit ends the phase)

    def next_wake(self) -> float | None:
        """When `tick` has a deadline to act on."""
        deadlines = [u.phase_until for u in self.sup.units.values() if u.phase is not None]
        return min(deadlines, default=None)
