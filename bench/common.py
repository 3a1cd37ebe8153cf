"""What the side-by-side benches share: threads, quiet logs, timing, tables, JSON results, cleanup.

Each bench runs the things it compares in one process and one run, interleaved, so that the
noise of this shared machine hits both alike; the figures that count are ratios. Results go to
`bench/results/<name>.json` (git-ignored) with the conditions they were measured under.
"""

from __future__ import annotations

import contextlib
import datetime
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


def conditions(num_threads: int) -> dict:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    with contextlib.suppress(ImportError):
        import transformers

        versions["transformers"] = transformers.__version__
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


def write_results(name: str, results: dict) -> Path:
    """Write `bench/results/<name>.json`, adding the load average at the end of the run."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    results.setdefault("conditions", {})["load_average_at_end"] = list(os.getloadavg())
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nresults: {path.relative_to(REPO_ROOT)}")
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
