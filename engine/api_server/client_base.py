"""What both engine clients share: the ranks, the unfinished requests, and delivering outputs.

`EngineClient` (ZeroMQ to engine-core processes) and `InprocClient` (an
engine core in this process) offer the app the same API:

    await client.start(); await client.close()
    stream = client.add_request(prompt_token_ids, sampling, req_id)  # raises EngineUnavailable
    client.abort(stream)              # what stream.close() calls
    await client.call_utility(method, *args, dp_rank=None, timeout_s=5.0)
    await client.refresh_stats()      # {dp_rank: SchedulerStats}
    client.health(); client.is_ready(); client.max_model_len()
    client.set_external_load(dp_rank, num_requests)   # the coordinator's hook
    client.on_restart = callback(role)                # a core was replaced
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import msgspec

from engine.api_server.dp_ranks import DpRanks
from engine.api_server.request_stream import RequestStream
from engine.wire.protocol import RequestUpdate, SchedulerStats


class ClientBase:
    """Request bookkeeping and rank state; subclasses send and receive."""

    def __init__(self, data_parallel_size: int = 1, heartbeat_timeout_s: float = 5.0):
        self.ranks = DpRanks(data_parallel_size, heartbeat_timeout_s)
        self.requests: dict[str, RequestStream] = {}  # wire id -> stream, unfinished only
        self.stats: dict[int, SchedulerStats] = {}    # each rank's latest scheduler stats
        self.on_restart: Callable[[str], None] | None = None

    async def call_utility(self, method: str, *args, dp_rank: int | None = None, timeout_s: float = 5.0):
        """Call an engine-core method (`get_stats`, `ping`) on one rank (the least loaded if None)."""
        raise NotImplementedError

    async def refresh_stats(self, timeout_s: float = 1.0) -> dict[int, SchedulerStats]:
        """Ask every up rank for its scheduler stats now; a rank that does not answer keeps its last."""
        ranks = [r for r in self.ranks.ranks if self.ranks.is_up(r)]
        results = await asyncio.gather(*(self.call_utility("get_stats", dp_rank=r, timeout_s=timeout_s)
                                         for r in ranks), return_exceptions=True)
        for rank, result in zip(ranks, results):
            if isinstance(result, dict):
                self.stats[rank] = msgspec.convert(result, SchedulerStats)
        return dict(self.stats)

    # state, for /health, /metrics and routing

    def health(self) -> dict:
        """Each rank's state, and which are up, down and failed (see DpRanks.summary)."""
        return self.ranks.summary()

    def is_ready(self) -> bool:
        """Whether any rank is ready and heard from lately."""
        return any(self.ranks.is_up(r) for r in self.ranks.ranks)

    def max_model_len(self) -> int | None:
        """The context length the cores serve, once one said Ready."""
        return self.ranks.max_model_len()

    def set_external_load(self, dp_rank: int, num_requests: int | None) -> None:
        """Hook for the coordinator's load stats: requests of all API servers on a rank."""
        self.ranks.set_external_load(dp_rank, num_requests)

    # bookkeeping

    def _track(self, stream: RequestStream, dp_rank: int) -> None:
        stream.dp_rank = dp_rank
        self.requests[stream.wire_id] = stream
        self.ranks.get(dp_rank).num_in_flight += 1

    def _forget(self, stream: RequestStream) -> None:
        if self.requests.pop(stream.wire_id, None) is not None:
            self.ranks.get(stream.dp_rank).num_in_flight -= 1

    def _deliver(self, dp_rank: int, updates: Iterable[RequestUpdate], stats: SchedulerStats | None) -> None:
        """A core's outputs: each update to its stream; updates of unknown ids (aborted here,
        or from a core that was since replaced) are dropped."""
        self.ranks.heard(dp_rank)
        if stats is not None:
            self.stats[dp_rank] = stats
        for update in updates:
            stream = self.requests.get(update.req_id)
            if stream is None:
                continue
            if update.finish_reason is not None:
                self._forget(stream)
            stream.put(update)
