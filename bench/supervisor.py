"""The supervisor, measured side by side in one run:

- cold start of `vsup serve` (default model) to /health 200, and to the first token;
- kill -9 of the worker to the next token of a running stream (against the cold start);
- log throughput: lines/s through the log router (tag + vsup.jsonl) against the same lines to a file;
- the supervisor's CPU while the tree idles;
- `vsup ps` latency against `python -c "import typer"`.

    python bench/supervisor.py [--quick | --smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from common import add_mode_args, conditions, mode, print_table, write_results  # noqa: E402

VSUP = [sys.executable, "-m", "vsup"]
FLOOD = "import sys\nfor i in range({n}): sys.stdout.write('{{\"event\": \"line %d\", \"level\": \"info\"}}\\n' % i)\n"


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200
    except OSError:
        return False


def stream_token_times(port: int, max_tokens: int, times: list[float]) -> None:
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if line.startswith(b"data: {"):
                times.append(time.monotonic())


def serve_figures(home: str, max_tokens: int, idle_s: float = 3.0) -> dict:
    port = free_port()
    env = {**os.environ, "VSUP_HOME": home}
    start = time.monotonic()
    proc = subprocess.Popen([*VSUP, "serve", "--port", str(port), "--name", "bench"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not health(port):
            time.sleep(0.05)
        cold_start = time.monotonic() - start
        first: list[float] = []
        stream_token_times(port, 1, first)
        first_token = first[0] - start
        state = json.loads(subprocess.run([*VSUP, "ps", "--json", "--name", "bench"], env=env,
                                          capture_output=True, text=True).stdout)
        pids = {p["name"]: p["pid"] for p in state["processes"]}
        supervisor = psutil.Process(state["supervisor"]["pid"])
        cpu0, wall0 = sum(supervisor.cpu_times()[:2]), time.monotonic()
        time.sleep(idle_s)
        idle_cpu = (sum(supervisor.cpu_times()[:2]) - cpu0) / (time.monotonic() - wall0)
        times: list[float] = []
        reader = threading.Thread(target=stream_token_times, args=(port, max_tokens, times))
        reader.start()
        while len(times) < 10:
            time.sleep(0.01)
        os.kill(pids["worker dp0 pp0 tp0"], signal.SIGKILL)
        killed_at = time.monotonic()
        reader.join()
        after = [t for t in times if t > killed_at]
        gaps = [b - a for a, b in zip(times, times[1:])]
        return {"cold_start_to_health_s": cold_start, "cold_start_to_first_token_s": first_token,
                "kill9_worker_to_next_token_s": after[0] - killed_at if after else None,
                "tokens_after_kill": len(after), "median_inter_token_s": statistics.median(gaps),
                "supervisor_idle_cpu_share": idle_cpu}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def log_throughput(lines: int) -> dict:
    """Lines/s of one chatty child through the log router, against the child writing to a file itself."""
    from vsup.supervisor.log_router import JsonlWriter, LogRouter

    with tempfile.TemporaryDirectory() as tmp:
        script = FLOOD.format(n=lines)
        start = time.monotonic()
        with open(os.path.join(tmp, "direct.jsonl"), "w") as out:
            subprocess.run([sys.executable, "-c", script], stdout=out, check=True)
        direct = time.monotonic() - start

        writer = JsonlWriter(Path(tmp) / "vsup.jsonl")
        router = LogRouter([writer.write], flushes=[writer.flush])
        router.start()
        start = time.monotonic()
        out_r, out_w = os.pipe()
        child = subprocess.Popen([sys.executable, "-c", script], stdout=out_w)
        os.close(out_w)
        router.add(out_r, "stdout", {"name": "worker dp0 pp0 tp0", "role": "worker", "dp": 0, "pp": 0, "tp": 0,
                                     "pid": child.pid})
        child.wait()
        router.stop()
        routed = time.monotonic() - start
        writer.close()
        # past 16 MiB vsup.jsonl rotates into vsup.jsonl.1 ... (the full run's 200,000 lines fill three)
        oldest_first = sorted(Path(tmp).glob("vsup.jsonl*"), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit()
                              else 0)
        events = [json.loads(line)["event"] for path in oldest_first for line in open(path)]
    assert events == [f"line {i}" for i in range(lines)], \
        f"{len(events)} of {lines} lines reached vsup.jsonl, or not in the order written"
    return {"lines": lines, "direct_lines_per_s": lines / direct, "routed_lines_per_s": lines / routed,
            "routed_over_direct": direct / routed}


def ps_latency(runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="vsup-bench-ps-") as home:
        return _ps_latency(runs, home)


def _ps_latency(runs: int, home: str) -> dict:
    env = {**os.environ, "VSUP_HOME": home}
    os.makedirs(os.path.join(home, "bench"))
    Path(home, "bench", "state.json").write_text(json.dumps(
        {"supervisor": {"name": "bench", "state": "stopped", "model": "m", "url": "u", "pid": 1, "started_at": 0},
         "processes": []}))
    commands = {"vsup ps": [*VSUP, "ps", "--name", "bench"], "import typer": [sys.executable, "-c", "import typer"]}
    times: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            start = time.monotonic()
            subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, check=True)
            times[name].append(time.monotonic() - start)
    ps_s, typer_s = statistics.median(times["vsup ps"]), statistics.median(times["import typer"])
    return {"vsup_ps_s": ps_s, "import_typer_s": typer_s, "ratio": ps_s / typer_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_args(parser)
    args = parser.parse_args(argv)
    run_mode = mode(args)
    smoke = run_mode == "smoke"
    results = {"conditions": conditions(),
               "log": log_throughput(2_000 if smoke else 20_000 if args.quick else 200_000),
               "ps": ps_latency(1 if smoke else 5 if args.quick else 20)}
    with tempfile.TemporaryDirectory() as home:
        results["serve"] = serve_figures(home, 20 if smoke else 60 if args.quick else 200, 0.5 if smoke else 3.0)
    s, log, ps = results["serve"], results["log"], results["ps"]
    print_table("the supervisor", ["figure", "value"], [
        ["cold start to /health", f"{s['cold_start_to_health_s']:.1f} s"],
        ["cold start to first token", f"{s['cold_start_to_first_token_s']:.1f} s"],
        ["kill -9 worker to next token", f"{s['kill9_worker_to_next_token_s']:.1f} s "
                                         f"({s['kill9_worker_to_next_token_s'] / s['cold_start_to_first_token_s']:.2f}x cold start)"],
        ["median inter-token gap", f"{s['median_inter_token_s'] * 1000:.0f} ms"],
        ["supervisor CPU, tree idle", f"{s['supervisor_idle_cpu_share']:.2%} of a core"],
        ["log lines/s through the router", f"{log['routed_lines_per_s']:,.0f} "
                                           f"({log['routed_over_direct']:.2f}x a child writing its own file)"],
        ["vsup ps latency", f"{ps['vsup_ps_s'] * 1000:.0f} ms ({ps['ratio']:.2f}x import typer)"],
    ])
    write_results("supervisor", results, run_mode)


if __name__ == "__main__":
    main()
