"""What vsup costs around a stock vLLM: `vsup serve --engine vllm` against bare `vllm serve`, in one run.

Both sides serve the default model at vLLM's own defaults (compiled, its dtype, its memory share,
its binding): bare `vllm serve MODEL --served-model-name M --shutdown-timeout 5 --host H --port P`,
the argv and environment that vsup gives it (vsup/vllm/args.py) but for the socket, against
`vsup serve MODEL --engine vllm --served-model-name M --drain-timeout 5`, one after the other, the
order flipped every round. vsup's side is reached through its front (vsup/front), so its figures
hold the front's cost too:
- cold start, launch to the first /health 200 (goal: vsup at most +1 s);
- throughput at 16 and 64 streams of 64 tokens, the median of the rounds' ratios (goal: at least
  0.98x), and ITL p50 (goal: within 1.02x);
- under vsup only: kill -9 of the worker under a running stream to that stream's next token
  (the front resumes it on the new tree; bare vLLM fails it and exits), the same with
  --replicas 2 (the front moves it to the other tree; goal: under 2 s), kill -9 of the worker
  to the next new request served, and the lines/s vsup's log router takes from a process of
  the tree. These give vLLM `--kv-cache-memory 1GiB` (two trees at vLLM's default share of the
  memory would not fit).

    python bench/vllm_supervised.py [--quick | --smoke]     # --smoke: detection only, nothing started
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (Children, Server, add_mode_args, conditions, free_port, mode, print_table, ratio, run_streams,
                    settle, stream_summary, write_results)
from vllm_cpu import MODEL_NAME, detect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vsup.topology import ParallelConfig  # noqa: E402
from vsup.serve_flags import ServeFlags  # noqa: E402
from vsup.vllm.args import serve_argv, serve_env  # noqa: E402
from vsup.vllm.help import PROJECT_VENV_BIN  # noqa: E402

FLOOD_LINES = 20000
SMALL_KV = ("--kv-cache-memory", "1GiB")  # the healing figures' trees (see above)


def flags(model_dir: str, port: int) -> ServeFlags:
    """What `vsup serve --engine vllm` is given here, none of it a flag that vLLM would be told."""
    return ServeFlags(model=model_dir, served_model_name=MODEL_NAME, host="127.0.0.1", port=port, dtype="auto",
                      max_num_seqs=256, seed=0, drain_timeout=5, gpu_memory_utilization=0.9)


def bare(children: Children, model_dir: str, log_dir: Path) -> Server:
    """`vllm serve` as vsup would start it (at vLLM's defaults), without vsup."""
    port = free_port()
    config = ParallelConfig(device="cpu")
    argv = serve_argv(str(PROJECT_VENV_BIN), config, flags(model_dir, port))
    return Server("vllm serve", argv, port, log_dir / f"bare-{port}.log", children,
                  env=serve_env(config, flags(model_dir, port), [], None), model=MODEL_NAME)


def supervised(children: Children, model_dir: str, home: Path, env: dict | None = None, replicas: int = 1,
               extra: tuple[str, ...] = ()) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "vsup", "serve", model_dir, "--engine", "vllm", "--port", str(port),
            "--name", f"b{port}", "--served-model-name", MODEL_NAME, "--drain-timeout", "5", "--log-format", "json",
            "--replicas", str(replicas), *extra]
    return Server("vsup --engine vllm", argv, port, home / f"vsup-{port}.log", children,
                  env={"VSUP_HOME": str(home), **(env or {})}, model=MODEL_NAME)


def throughput(server: Server, streams: int, tokens: int) -> dict:
    run = asyncio.run(run_streams(server.url, server.model, [f"Tell me story {i}." for i in range(streams)], tokens))
    return stream_summary(run)


def side_by_side(model_dir: str, rounds: int, stream_counts: list[int], tokens: int) -> dict:
    samples = {side: {"health_s": [], **{f"{k}_{n}": [] for n in stream_counts for k in ("tok_s", "itl_p50_ms")}}
               for side in ("vsup", "vllm")}
    with tempfile.TemporaryDirectory(prefix="vsup-bench-vllm-sup-") as tmp:
        for r in range(rounds):
            for side in ("vsup", "vllm") if r % 2 == 0 else ("vllm", "vsup"):
                with Children(grace_s=30) as children:
                    server = supervised(children, model_dir, Path(tmp)) if side == "vsup" \
                        else bare(children, model_dir, Path(tmp))
                    samples[side]["health_s"].append(server.wait_ready(timeout_s=600))
                    throughput(server, 1, 8)  # warm-up
                    for n in stream_counts:
                        settle(children.procs)
                        summary = throughput(server, n, tokens)
                        samples[side][f"tok_s_{n}"].append(summary["tokens_per_s"])
                        samples[side][f"itl_p50_ms_{n}"].append(summary["itl_p50_ms"])
                    server.stop()
                print(f"  round {r} {side}: /health {samples[side]['health_s'][-1]:.1f} s, "
                      + ", ".join(f"{n} streams {samples[side][f'tok_s_{n}'][-1]:.0f} tok/s" for n in stream_counts),
                      flush=True)
    best = {side: {k: statistics.median(v) for k, v in s.items()} for side, s in samples.items()}  # (medians)
    out = {"rounds": rounds, "samples": samples, "best": best,
           "health_extra_s": best["vsup"]["health_s"] - best["vllm"]["health_s"]}
    for n in stream_counts:  # (each round's ratio, then their median)
        pairs = list(zip(samples["vsup"][f"tok_s_{n}"], samples["vllm"][f"tok_s_{n}"]))
        out[f"vsup_over_vllm_tok_s_{n}"] = statistics.median(ratio(a, b) for a, b in pairs)
        itl = list(zip(samples["vsup"][f"itl_p50_ms_{n}"], samples["vllm"][f"itl_p50_ms_{n}"]))
        out[f"itl_p50_extra_ms_{n}"] = statistics.median(a - b for a, b in itl)
        out[f"itl_p50_ratio_{n}"] = statistics.median(ratio(a, b) for a, b in itl)
    return out


def ps(home: Path, name: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "vsup", "ps", "--name", name, "--json"], capture_output=True,
                         text=True, env={**os.environ, "VSUP_HOME": str(home)})
    return json.loads(out.stdout)


def heal_and_flood(model_dir: str) -> dict:
    """Under vsup: kill -9 of the worker -> the next token served; lines/s from a flooding process."""
    import httpx

    with tempfile.TemporaryDirectory(prefix="vsup-bench-vllm-heal-") as tmp, Children(grace_s=30) as children:
        home = Path(tmp)
        flood = f"VLLM::Worker|{'x' * 100}|{FLOOD_LINES}"
        server = supervised(children, model_dir, home, env={"VSUP_HOOK_TEST_FD2": flood}, extra=SMALL_KV)
        server.wait_ready(timeout_s=600)
        name = server.proc.args[server.proc.args.index("--name") + 1]
        log = home / name / "logs" / "vsup.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sum(1 for line in open(log) if '"x' in line) < FLOOD_LINES:
            time.sleep(0.2)
        stamps = [json.loads(line)["ts"] for line in open(log) if '"x' in line]
        from datetime import datetime

        span = (datetime.fromisoformat(stamps[-1].rstrip("Z")) - datetime.fromisoformat(stamps[0].rstrip("Z")))
        lines_per_s = (len(stamps) - 1) / max(span.total_seconds(), 1e-6)
        paused_s = pause_at_kill(server.url, lambda: next(p["pid"] for p in ps(home, name)["processes"]
                                                          if p["role"] == "worker"))
        worker = next(p["pid"] for p in ps(home, name)["processes"] if p["role"] == "worker" and p["pid"])
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        served_s = None
        while time.monotonic() - killed < 600:
            try:
                if httpx.post(f"{server.url}/v1/completions", json=body, timeout=5).status_code == 200 and \
                        time.monotonic() - killed > 1:
                    served_s = time.monotonic() - killed
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        server.stop()
    return {"log_lines_per_s": lines_per_s, "flood_lines": len(stamps), "kill_worker_to_next_token_s": served_s,
            "kill_worker_to_streams_next_token_s": paused_s}


def replicas_heal(model_dir: str) -> dict:
    """Under vsup with --replicas 2: kill -9 of the worker of the tree that runs a stream, to that
    stream's next token (the front moves it to the other tree)."""
    import re

    import httpx

    with tempfile.TemporaryDirectory(prefix="vsup-bench-vllm-replicas-") as tmp, Children(grace_s=30) as children:
        home = Path(tmp)
        server = supervised(children, model_dir, home, replicas=2, extra=SMALL_KV)
        server.wait_ready(timeout_s=900)
        name = server.proc.args[server.proc.args.index("--name") + 1]
        deadline = time.monotonic() + 600  # both trees up, not just the first
        while time.monotonic() < deadline and not all(p["state"] == "ready" for p in ps(home, name)["processes"]):
            time.sleep(0.5)

        def worker_of_busy_tree() -> int:
            text = httpx.get(f"{server.url}/metrics", timeout=30).text
            busy = re.search(r'^vllm:num_requests_running\{replica="r(\d+)"[^}]*\} ([1-9])', text, re.M)
            r = int(busy[1]) if busy else 0
            return next(p["pid"] for p in ps(home, name)["processes"] if p["role"] == "worker" and p.get("r") == r)
        paused_s = pause_at_kill(server.url, worker_of_busy_tree)
        server.stop()
    return {"kill_worker_to_streams_next_token_s": paused_s}


def pause_at_kill(url: str, victim) -> float | None:
    """kill -9 of the worker `victim()` names once a stream has 8 chunks; the longest pause of that same
    stream from then on (from the kill to its next chunk, or between two of its chunks), or None when
    the stream did not reach its 64 tokens. (vLLM puts tokens that are ready together into one chunk, so
    under load a stream of 64 tokens may come in fewer chunks.)"""
    import httpx

    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "stream": True,
            "ignore_eos": True}
    stamps = []
    killed, finish = None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.monotonic())
                finish = json.loads(line[len("data: "):])["choices"][0].get("finish_reason") or finish
                if len(stamps) == 8:
                    worker = victim()
                    killed = time.monotonic()
                    os.kill(worker, signal.SIGKILL)
    after = [t for t in stamps if killed is not None and t > killed]
    if not after or finish != "length":
        return None
    return max(b - a for a, b in zip([killed, *after], after))  # (a token already on its way comes first)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_args(parser)
    args = parser.parse_args(argv)
    run_mode = mode(args)
    results: dict = {"conditions": conditions(), "detect": detect()}
    found = results["detect"]
    print(f"vLLM-CPU: {'version ' + found['version'] if found['available'] else 'not available: ' + found['why_not']}")
    if found["available"] and run_mode != "smoke":
        from engine.model.default_model import default_model_dir

        model_dir = str(default_model_dir())
        quick = run_mode == "quick"
        s = results["side_by_side"] = side_by_side(model_dir, 1 if quick else 3, [16] if quick else [16, 64], 64)
        rows = [["cold start to /health, s", s["best"]["vsup"]["health_s"], s["best"]["vllm"]["health_s"],
                 f"{s['health_extra_s']:+.1f} s"]]
        for n in [16] if quick else [16, 64]:
            rows += [[f"{n} streams, tok/s", s["best"]["vsup"][f"tok_s_{n}"], s["best"]["vllm"][f"tok_s_{n}"],
                      f"{s[f'vsup_over_vllm_tok_s_{n}']:.3f}x"],
                     [f"{n} streams, ITL p50 ms", s["best"]["vsup"][f"itl_p50_ms_{n}"],
                      s["best"]["vllm"][f"itl_p50_ms_{n}"],
                      f"{s[f'itl_p50_ratio_{n}']:.3f}x ({s[f'itl_p50_extra_ms_{n}']:+.2f} ms)"]]
        print_table("vsup --engine vllm against bare vllm serve, both at vLLM's defaults (medians)",
                    ["", "vsup", "vLLM", "vsup/vLLM"],
                    rows)
        h = results["heal"] = heal_and_flood(model_dir)
        print_table("under vsup only", ["figure", "value"],
                    [["log lines/s through the supervisor", f"{h['log_lines_per_s']:.0f}"],
                     ["kill -9 of the worker -> the running stream's next token, s",
                      h["kill_worker_to_streams_next_token_s"]],
                     ["kill -9 of the worker -> next new request served, s", h["kill_worker_to_next_token_s"]]])
        r = results["replicas"] = replicas_heal(model_dir)
        print_table("under vsup, --replicas 2", ["figure", "value"],
                    [["kill -9 of the worker -> the running stream's next token, s",
                      r["kill_worker_to_streams_next_token_s"]]])
    write_results("vllm_supervised", results, run_mode)


if __name__ == "__main__":
    sys.exit(main())
