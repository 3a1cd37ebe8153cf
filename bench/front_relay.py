"""How fast vsup's front relays a stream (issue 47): what it adds where vLLM on a GPU streams faster than any CPU
vLLM here can.

A stand-in upstream (this file, `--upstream SOCKET`) serves /v1/completions on a Unix socket as `vllm serve --uds`
does, with chunks shaped like vLLM 0.32's with `return_token_ids` (one token each, its id, the prompt's ids in the
first): in steps, one chunk to every running stream a step, as an engine does, either as fast as it can (`flood`)
or one step every PACE ms (`paced`). The front (`python -m vsup.front`, as `vsup serve --engine vllm` starts it,
told by a stand-in supervisor that the tree is up) runs on the first core alone; the upstream and the clients (raw
asyncio HTTP/1.1, one connection a stream, counting events) on the other cores. Each case runs straight to the
upstream and through the front, interleaved, the order flipped every round:

- capacity: 256 streams of 200 tokens, flood: tokens/s the clients get (straight: what the harness can);
- latency: 256 streams of 100 tokens paced so that the upstream offers 20,000 tokens/s: ITL p50/p99 straight and
  through the front (added = the difference).

    python bench/front_relay.py [--quick | --smoke] [--streams N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (REPO_ROOT, Children, add_mode_args, conditions, free_port, http_ok, mode, percentile, print_table,
                    write_results)

GOAL_TOKENS_S = 20_000
GOAL_ITL_P99_ADDED_MS = 1.0


# the stand-in upstream

def chunk(i: int, token: int, first: bool, last: bool) -> bytes:
    body = {"id": f"cmpl-{i}", "object": "text_completion", "created": 1765000000, "model": "m",
            "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": "length" if last else None,
                         "stop_reason": None, "token_ids": [token],
                         **({"prompt_token_ids": list(range(1000, 1020))} if first else {})}], "usage": None}
    data = b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


DONE = b"data: [DONE]\n\n"
END = b"%x\r\n%s\r\n0\r\n\r\n" % (len(DONE), DONE)


class Upstream:
    """Streams of /v1/completions, a step at a time: every running stream gets its next chunk in each step."""

    def __init__(self, pace_s: float):
        self.pace_s = pace_s
        self.running: list[list] = []  # [writer, stream id, tokens left, sent, done future]
        self.wake = asyncio.Event()
        self.count = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = json.loads(await reader.readexactly(length)) if length else {}
                if head.startswith(b"GET /health"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                done = asyncio.get_running_loop().create_future()
                self.count += 1
                self.running.append([writer, self.count, int(body.get("max_tokens", 16)), 0, done])
                self.wake.set()
                await done
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def steps(self) -> None:
        while True:
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
            started = time.perf_counter()
            for stream in list(self.running):
                writer, i, left, sent, done = stream
                writer.write(chunk(i, 5000 + sent, sent == 0, left == 1))
                stream[2], stream[3] = left - 1, sent + 1
                if left == 1:
                    writer.write(END)
                    self.running.remove(stream)
                    done.set_result(None)
            await asyncio.gather(*(s[0].drain() for s in self.running), return_exceptions=True)
            await asyncio.sleep(max(0.0, self.pace_s - (time.perf_counter() - started)))


async def upstream_main(path: str, pace_s: float) -> None:
    up = Upstream(pace_s)
    server = await asyncio.start_unix_server(up.serve, path, limit=1 << 20, backlog=4096)
    os.chmod(path, 0o600)
    asyncio.get_running_loop().create_task(up.steps())
    async with server:
        await server.serve_forever()


# the clients

async def one_stream(connect, max_tokens: int, host: str) -> list[float]:
    """Arrival times of the events of one streamed completion (the [DONE] not counted)."""
    reader, writer = await connect()
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": max_tokens, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    times, pending = [], b""
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            break
        data = pending + (await reader.readexactly(size + 2))[:-2]
        now = time.perf_counter()
        events = data.split(b"\n\n")
        pending = events.pop()
        times += [now for e in events if e.startswith(b"data: {")]
        if any(e == b"data: [DONE]" for e in events):
            break
    writer.close()
    return times


async def run(streams: int, tokens: int, connect, host: str) -> dict:
    start = time.perf_counter()
    arrivals = await asyncio.gather(*(one_stream(connect, tokens, host) for _ in range(streams)))
    wall = time.perf_counter() - start
    got = sum(len(a) for a in arrivals)
    itl = [b - a for times in arrivals for a, b in zip(times, times[1:])]
    return {"tokens": got, "wall_s": wall, "tokens_per_s": got / wall, "itl_p50_ms": percentile(itl, 50) * 1e3,
            "itl_p99_ms": percentile(itl, 99) * 1e3, "complete": got == streams * tokens}


def measure(target: str, streams: int, tokens: int, socket_path: str, port: int) -> dict:
    if target == "straight":
        def connect():
            return asyncio.open_unix_connection(socket_path, limit=1 << 20)
    else:
        def connect():
            return asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    return asyncio.run(run(streams, tokens, connect, "vllm" if target == "straight" else f"127.0.0.1:{port}"))


# the processes

def start_upstream(children: Children, path: str, pace_s: float, cores: str) -> subprocess.Popen:
    cpus = {int(c) for c in cores.split(",")}
    proc = children.spawn([sys.executable, __file__, "--upstream", path, "--pace", str(pace_s)], cwd=REPO_ROOT / "bench",
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the stand-in upstream did not start")
        time.sleep(0.05)
    return proc


def start_front(children: Children, path: str, port: int, core: int) -> subprocess.Popen:
    """The front as `vsup serve --engine vllm` starts it (vsup/vllm/launch.py), on `core` alone."""
    from vsup.messages import TreeNews, encode_line

    proc = children.spawn([sys.executable, "-m", "vsup.front", "--host", "127.0.0.1", "--port", str(port),
                           "--upstream", path, "--resume-timeout", "60", "--max-pending", "1024", "--max-resumes", "2",
                           "--drain-timeout", "5", "--cpus", str(core)], stdin=subprocess.PIPE, cwd=REPO_ROOT)
    proc.stdin.write(encode_line(TreeNews(0, 1, True)))
    proc.stdin.flush()
    deadline = time.monotonic() + 60
    while not http_ok(f"http://127.0.0.1:{port}/health"):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the front did not start")
        time.sleep(0.05)
    return proc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mode_args(parser)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)  # (this file as the stand-in upstream)
    parser.add_argument("--pace", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=256)
    args = parser.parse_args(argv)
    if args.upstream:
        asyncio.run(upstream_main(args.upstream, args.pace))
        return
    run_mode = mode(args)
    rounds, streams, tokens = {"smoke": (1, 8, 10), "quick": (2, args.streams, 100)}.get(run_mode,
                                                                                          (3, args.streams, 200))
    cores = os.sched_getaffinity(0)
    front_core = min(cores)
    others = ",".join(str(c) for c in sorted(cores - {front_core})) or str(front_core)
    os.sched_setaffinity(0, {int(c) for c in others.split(",")})  # the clients off the front's core
    pace_s = streams / GOAL_TOKENS_S  # one step gives every stream a token: the upstream offers the goal's rate
    cases = {"capacity": (0.0, tokens), "latency": (pace_s, max(10, tokens // 2))}
    results = {"conditions": conditions(), "streams": streams, "cases": {}, "goals": {
        "tokens_per_s": GOAL_TOKENS_S, "itl_p99_added_ms": GOAL_ITL_P99_ADDED_MS}, "front_core": front_core,
        "client_cores": others}
    with tempfile.TemporaryDirectory(prefix="vsup-bench-front-") as tmp:
        for case, (pace, n) in cases.items():
            samples = {"straight": [], "front": []}
            with Children(grace_s=5) as children:
                path = str(Path(tmp) / f"{case}.sock")
                start_upstream(children, path, pace, others)
                port = free_port()
                start_front(children, path, port, front_core)
                measure("front", min(streams, 8), 4, path, port)  # warm-up
                for r in range(rounds):
                    for target in ("straight", "front") if r % 2 == 0 else ("front", "straight"):
                        samples[target].append(measure(target, streams, n, path, port))
                        s = samples[target][-1]
                        print(f"  {case:8} round {r + 1} {target:8}: {s['tokens_per_s']:9.0f} tok/s, ITL p50 "
                              f"{s['itl_p50_ms']:.2f} ms p99 {s['itl_p99_ms']:.2f} ms", flush=True)
            results["cases"][case] = {
                "pace_ms": pace * 1e3, "tokens_per_stream": n, "samples": samples,
                **{f"{t}_{k}": statistics.median(s[k] for s in samples[t])
                   for t in samples for k in ("tokens_per_s", "itl_p50_ms", "itl_p99_ms")},
                "complete": all(s["complete"] for t in samples for s in samples[t])}
    cap, lat = results["cases"]["capacity"], results["cases"]["latency"]
    results["front_tokens_per_s"] = cap["front_tokens_per_s"]
    results["itl_p99_added_ms"] = lat["front_itl_p99_ms"] - lat["straight_itl_p99_ms"]
    print_table(f"{streams} streams, medians of {rounds} rounds", ["case", "straight tok/s", "front tok/s",
                                                                   "straight ITL p99", "front ITL p99"],
                [[c, v["straight_tokens_per_s"], v["front_tokens_per_s"], v["straight_itl_p99_ms"],
                  v["front_itl_p99_ms"]] for c, v in results["cases"].items()])
    print(f"\nthrough the front: {results['front_tokens_per_s']:.0f} tokens/s on one core (goal >= {GOAL_TOKENS_S:,}); "
          f"ITL p99 added at {GOAL_TOKENS_S:,} tokens/s offered: {results['itl_p99_added_ms']:.2f} ms "
          f"(goal <= {GOAL_ITL_P99_ADDED_MS})")
    write_results("front_relay", results, run_mode)


if __name__ == "__main__":
    main()
