"""The coordinator process: every core's load reaches every API server, fast on change, steady otherwise."""

import subprocess
import sys
import time

import zmq

from engine.wire.protocol import CoreLoad, coordinator_out, encoder


def test_load_is_published_within_100ms_of_a_change(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "engine.coordinator", "--data-parallel-size", "2",
                             "--input-address", f"ipc://{tmp_path}/in.sock",
                             "--output-address", f"ipc://{tmp_path}/out.sock"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ctx = zmq.Context()
    sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{tmp_path}/out.sock")
        push.connect(f"ipc://{tmp_path}/in.sock")
        assert sub.poll(10_000), "no heartbeat"
        first = coordinator_out.decode(sub.recv())
        assert first.ranks == {0: [0, 0], 1: [0, 0]}
        push.send(b"\xc1 not msgpack")
        push.send(encoder.encode(CoreLoad(1, 3, 2, 10, 4, 5)))
        while True:
            assert sub.poll(2000)
            stats = coordinator_out.decode(sub.recv())
            if stats.ranks[1] == [3, 2]:
                break
        assert stats.ranks[0] == [0, 0]
        assert stats.counters[1] == [10, 4, 5] and stats.counters[0] == [0, 0, 0]  # steps, dummy steps, requests
    finally:
        sub.close(linger=0)
        push.close(linger=0)
        ctx.term()
        proc.terminate()
        out, err = proc.communicate(timeout=10)
    assert b'"event": "ready"' in out and b"dropped malformed message" in out


def test_api_server_client_routes_by_the_coordinators_load(tmp_path):
    import asyncio

    from engine.api_server.engine_client import EngineClient
    from engine.wire.protocol import LoadStats

    async def scenario():
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"ipc://{tmp_path}/load.sock")
        client = EngineClient(f"ipc://{tmp_path}/engines.sock", 2, coordinator_address=f"ipc://{tmp_path}/load.sock")
        await client.start()
        try:
            for _ in range(100):  # until the subscription has reached the publisher
                pub.send(encoder.encode(LoadStats(ranks={0: [5, 3], 1: [0, 1]}, published_at=time.time())))
                await asyncio.sleep(0.02)
                if client.ranks.get(0).external_load == 8:
                    break
            assert client.ranks.get(0).external_load == 8 and client.ranks.get(1).external_load == 1
        finally:
            await client.close()
            pub.close(linger=0)
            ctx.term()

    asyncio.run(scenario())
