"""Who this process is in the tree: its name, its title, and its tie to the supervisor.

Every entry point (`python -m engine.worker`, ...) calls `become()` first.
The supervisor passes the name and title in the environment (vsup's topology
spells them), so the engine never re-derives them.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def process_name(default: str) -> str:
    """The name the supervisor gave this process (`worker dp0 pp0 tp1`), or `default`."""
    return os.environ.get("VSUP_PROCESS_NAME", default)


def die_with_supervisor() -> None:
    """Under a supervisor (VSUP_SUPERVISOR_PID set), get SIGKILL when it dies.

    Entry points call this before their heavy imports. PR_SET_PDEATHSIG is
    set by the child itself, so it holds whoever spawned it; a supervisor
    that died before this call is caught by comparing getppid() with its pid.
    """
    supervisor = os.environ.get("VSUP_SUPERVISOR_PID")
    if supervisor and sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != int(supervisor):
            os._exit(1)  # the supervisor is already gone: nobody would ever stop us


def place_self() -> None:
    """Take the place the supervisor gave this process (vsup/placement.py): its CPUs (VSUP_CPUS, such
    as `0,1,2`) and nice value (VSUP_NICE). Called before any thread starts, so every thread this
    process makes inherits them."""
    cpus = os.environ.get("VSUP_CPUS")
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    nice = os.environ.get("VSUP_NICE")
    if nice:
        os.setpriority(os.PRIO_PROCESS, 0, int(nice))


def threads(default: int) -> int:
    """The threads the supervisor's placement gives this process (VSUP_THREADS), else `default`."""
    return int(os.environ.get("VSUP_THREADS") or default)


def become(default_name: str) -> str:
    """Set the process title, take its place and die with the supervisor; returns the process name."""
    die_with_supervisor()
    place_self()
    name = process_name(default_name)
    title = os.environ.get("VSUP_PROCESS_TITLE", "vsup::" + name.replace(" ", "_"))
    try:
        import setproctitle
        setproctitle.setproctitle(title)
    except ImportError:  # pragma: no cover - a declared dependency
        pass
    return name


def freeze_heap() -> None:
    """Once started (imports, model, caches in place): what the process holds so far leaves the garbage
    collector's sight (gc.freeze, as vLLM does after its startup), so that a full collection while it
    serves scans only what came since. Without it, the API server's full collections took 30-38 ms
    each while it served 64 streams: a pause that every stream's next token waited for. Only the
    youngest objects are collected first (a full collection here took a worker 100 ms, on each
    restart); older garbage, if any, stays frozen."""
    gc.collect(0)
    gc.freeze()


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(0): the process unwinds through its `finally` blocks (sockets closed,
    workers told, rings left) and exits 0, as a stop asked for, rather than dying by the signal.

    Once only: a second SIGTERM while it unwinds, or one that comes after the process has begun to
    stop (`stopping`) or to exit (its atexit callbacks, torch's among them), is ignored, so it never cuts
    a cleanup short."""
    signal.signal(signal.SIGTERM, _raise_exit)
    atexit.register(stopping)  # (runs before the callbacks registered earlier: torch's)


def stopping() -> None:
    """The process stops of its own accord (told to by its engine core, say, or its main is done): from
    now on a SIGTERM (the supervisor's stop, coming at the same time) is ignored, not raised mid-cleanup."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _raise_exit(signum, frame):
    stopping()
    raise SystemExit(0)
