"""EngineClient against fake engine cores on real ZeroMQ sockets: routing, outputs, aborts,
resubmission to a replaced core, routing around a failed one. InprocClient on a fake core."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio

from engine.api_server.engine_client import EngineClient, EngineUnavailable
from engine.api_server.inproc_client import InprocClient, InprocConfig
from engine.wire.protocol import (AbortRequests, AddRequest, Failed, Hello, Outputs, Ready, RequestUpdate,
                                  SchedulerStats, UtilityCall, UtilityResult, encoder, to_core)
from engine.wire.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8)
STATS = SchedulerStats(1, 2, 0.5, 0.0, 0, 0, 0)


class FakeCore:
    """An engine core's DEALER, driven by the test."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, dp_rank: int, instance: str):
        self.dp_rank, self.instance = dp_rank, instance
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"dp{dp_rank}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    async def say(self, msg) -> None:
        await self.sock.send(encoder.encode(msg))

    async def start(self) -> None:
        await self.say(Hello(self.dp_rank, self.instance, 4242))
        await self.say(Ready(self.dp_rank, self.instance, 256, 64, 16))

    async def recv(self, timeout_s: float = 5.0):
        return to_core.decode(await asyncio.wait_for(self.sock.recv(), timeout_s))

    async def outputs(self, *updates: RequestUpdate) -> None:
        await self.say(Outputs(self.dp_rank, list(updates), STATS))


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def run(tmp_path, scenario, num_ranks: int = 2):
    """Run `scenario(client, ctx, address)` against a started client; close everything after."""
    async def main():
        address = f"ipc://{tmp_path}/a0.sock"
        client = EngineClient(address, num_ranks)
        ctx = zmq.asyncio.Context()
        await client.start()
        try:
            await scenario(client, ctx, address)
        finally:
            await client.close()
            ctx.destroy(linger=0)
    asyncio.run(main())


async def started(ctx, address, ranks, prefix="i"):
    cores = [FakeCore(ctx, address, r, f"{prefix}{r}") for r in ranks]
    for core in cores:
        await core.start()
    return cores


def test_routes_to_least_loaded_delivers_outputs_and_aborts(tmp_path):
    async def scenario(client, ctx, address):
        with pytest.raises(EngineUnavailable):
            client.add_request([1, 2], PARAMS)
        core0, core1 = await started(ctx, address, [0, 1])
        await until(lambda: client.health()["up"] == [0, 1])
        a, b = client.add_request([1, 2], PARAMS, "a"), client.add_request([3], PARAMS, "b")
        add_a, add_b = await core0.recv(), await core1.recv()
        assert (add_a.req_id, add_a.prompt_token_ids, add_b.req_id) == ("a", [1, 2], "b")
        await core0.outputs(RequestUpdate("a", [5]))
        await core0.outputs(RequestUpdate("a", [6], finish_reason="length"))
        got = [u async for batch in a for u in batch]
        assert [t for u in got for t in u.new_token_ids] == [5, 6] and a.finish_reason == "length"
        b.close()
        assert await core1.recv() == AbortRequests(["b"]) and b.finish_reason == "abort"
        await core1.outputs(RequestUpdate("b", [9]))  # late: dropped
        await asyncio.sleep(0.05)
        assert b.output_token_ids == [] and client.requests == {}
        assert client.ranks.get(0).num_in_flight == client.ranks.get(1).num_in_flight == 0
        assert client.stats[0] == STATS

    run(tmp_path, scenario)


def test_replaced_core_gets_the_requests_with_their_tokens_so_far(tmp_path):
    async def scenario(client, ctx, address):
        restarts = []
        client.on_restart = restarts.append
        (old,) = await started(ctx, address, [0])
        await until(client.is_ready)
        stream = client.add_request([1, 2, 3], PARAMS, "x")
        assert (await old.recv()).req_id == "x"
        await old.outputs(RequestUpdate("x", [7, 8]))
        await until(lambda: stream.output_token_ids == [7, 8])
        new = FakeCore(ctx, address, 0, "replacement")  # kill -9 and a restart, as the supervisor does it
        old.sock.close()
        await new.start()
        resubmitted = await new.recv()
        assert isinstance(resubmitted, AddRequest) and resubmitted.req_id == "x~2"
        assert (resubmitted.prompt_token_ids, resubmitted.output_token_ids) == ([1, 2, 3], [7, 8])
        assert resubmitted.sampling == PARAMS and restarts == ["engine-core"]
        await new.outputs(RequestUpdate("x", [99]), RequestUpdate("x~2", [9], finish_reason="length"))
        await until(lambda: stream.is_finished)
        assert stream.output_token_ids == [7, 8, 9]
        assert client.health()["dp_ranks"]["0"]["num_restarts"] == 1

    run(tmp_path, scenario, num_ranks=1)


def test_a_replacement_whose_hello_was_lost_is_known_by_its_heartbeat(tmp_path):
    """A reconnection can lose the Hello (and an API server that restarted never saw it): the Ready every
    second names the core, so its requests move to it and /health shows its pid, not the old one's."""
    async def scenario(client, ctx, address):
        (old,) = await started(ctx, address, [0])
        await until(client.is_ready)
        stream = client.add_request([1, 2, 3], PARAMS, "x")
        assert (await old.recv()).req_id == "x"
        new = FakeCore(ctx, address, 0, "replacement")
        old.sock.close()
        await new.say(Ready(0, "replacement", 256, 64, 16, pid=5151, node="node1"))
        resubmitted = await new.recv()
        assert resubmitted.req_id == "x~2" and stream.dp_rank == 0
        rank = client.health()["dp_ranks"]["0"]
        assert (rank["pid"], rank["num_restarts"]) == (5151, 1)

    run(tmp_path, scenario, num_ranks=1)


def test_failed_rank_hands_its_requests_to_another_or_ends_them(tmp_path):
    async def scenario(client, ctx, address):
        core0, core1 = await started(ctx, address, [0, 1])
        await until(lambda: client.health()["up"] == [0, 1])
        stream = client.add_request([4], PARAMS, "y")
        assert (await core0.recv()).req_id == "y"
        await core0.outputs(RequestUpdate("y", [1]))
        await until(lambda: stream.output_token_ids == [1])
        await core0.say(Failed(0, "workers never came back"))
        moved = await core1.recv()
        assert (moved.req_id, moved.output_token_ids) == ("y~2", [1])
        await core1.say(Failed(1, "oom"))
        await until(lambda: stream.is_finished)
        assert stream.finish_reason == "error" and "oom" in stream.error
        with pytest.raises(EngineUnavailable, match="dp0: workers never came back"):
            client.add_request([1], PARAMS)
        assert client.health()["failed"] == [0, 1]

    run(tmp_path, scenario)


def test_a_vanished_core_is_routed_around_at_once(tmp_path):
    async def scenario(client, ctx, address):
        core0, core1 = await started(ctx, address, [0, 1])
        await until(lambda: client.health()["up"] == [0, 1])
        core0.sock.close()  # kill -9: the ROUTER drops its peer
        await asyncio.sleep(0.2)
        stream = client.add_request([4], PARAMS, "z")
        assert (await core1.recv()).req_id == stream.wire_id and stream.dp_rank == 1

    run(tmp_path, scenario)


def test_utility_calls_and_malformed_messages(tmp_path):
    async def scenario(client, ctx, address):
        (core,) = await started(ctx, address, [0])
        await until(client.is_ready)
        await core.sock.send(b"\xc1 not msgpack")
        await core.sock.send_multipart([b"two", b"frames"])

        async def answer():
            call = await core.recv()
            assert isinstance(call, UtilityCall) and call.method == "get_stats"
            stats = {f: getattr(STATS, f) for f in STATS.__struct_fields__}
            await core.say(UtilityResult(call.call_id, stats))

        answering = asyncio.create_task(answer())
        assert (await client.refresh_stats())[0] == STATS
        await answering
        with pytest.raises(asyncio.TimeoutError):
            await client.call_utility("ping", dp_rank=0, timeout_s=0.2)
        assert isinstance(await core.recv(), UtilityCall)
        assert client.is_ready()

    run(tmp_path, scenario, num_ranks=1)


class FakeEngineCore:
    """EngineCore's surface, counting down max_tokens: InprocClient's thread without torch."""

    config = SimpleNamespace(max_model_len=64, num_blocks=8)

    def __init__(self):
        self.left: dict[str, int] = {}
        self.closed = False

    def add_request(self, add: AddRequest):
        if add.prompt_token_ids == [0]:
            return RequestUpdate(add.req_id, finish_reason="error", error="refused")
        self.left[add.req_id] = add.sampling.max_tokens

    def abort_requests(self, req_ids):
        return [RequestUpdate(r, finish_reason="abort") for r in req_ids if self.left.pop(r, None) is not None]

    def has_work(self):
        return bool(self.left)

    def step(self):
        time.sleep(0.01)
        updates = []
        for req_id in list(self.left):
            self.left[req_id] -= 1
            done = self.left[req_id] == 0
            updates.append(RequestUpdate(req_id, [self.left[req_id]], finish_reason="length" if done else None))
            if done:
                del self.left[req_id]
        return updates

    def stats(self):
        return STATS

    def close(self):
        self.closed = True


def test_in_process_client_steps_a_core_in_its_thread():
    async def main():
        core = FakeEngineCore()
        client = InprocClient(InprocConfig(model="unused"), build=lambda config: core)
        await client.start()
        await until(client.is_ready)
        stream = client.add_request([1, 2], SamplingParams(max_tokens=3))
        assert [t for batch in [u async for u in stream] for u in batch for t in u.new_token_ids] == [2, 1, 0]
        refused = client.add_request([0], PARAMS)
        await until(lambda: refused.is_finished)
        assert refused.finish_reason == "error" and refused.error == "refused"
        long = client.add_request([1], SamplingParams(max_tokens=1000))
        await until(lambda: long.output_token_ids)
        long.close()
        await until(lambda: not core.left)
        assert (await client.refresh_stats())[0] == STATS and client.requests == {}
        await client.close()
        assert core.closed

        fatal = []
        broken = InprocClient(InprocConfig(model="unused"), build=lambda config: 1 / 0, on_fatal=fatal.append)
        await broken.start()
        await until(lambda: broken.health()["failed"] == [0])
        assert fatal == ["ZeroDivisionError: division by zero"]  # the API server ends, for a restart
        with pytest.raises(EngineUnavailable, match="ZeroDivisionError"):
            broken.add_request([1], PARAMS)
        await broken.close()

    asyncio.run(main())
