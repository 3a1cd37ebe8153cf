"""vsup's start-up hook in every process of a stock vLLM tree (DESIGN.md section 8).

`vsup serve --engine vllm` puts this directory first on the PYTHONPATH of
`vllm serve`, so Python imports this module at start-up in every process of the
tree that vLLM spawns; `os.register_at_fork` covers the ones it forks. It does
nothing unless VSUP_HOOK_SOCKET is set. In each process it:

- points fds 1 and 2 at two connections to the supervisor's hook socket, each
  opened by one JSON line ({"pid", "ppid", "stream"}): the supervisor tags every
  line, native writes and tracebacks included, with the process that wrote it;
- sets PR_SET_PDEATHSIG (SIGKILL), and ends at once when its parent already
  went before that took hold;
- ends itself when the supervisor goes (its end of the connection closes),
  whatever became of the parents in between;
- appends each shared-memory segment and semaphore that multiprocessing
  registers to VSUP_HOOK_SHM_LOG, so that what a killed tree leaves in /dev/shm
  can be found and removed;
- in `vllm serve` itself, when it is the one API server, adds vsup's restart
  counters to vLLM's own /metrics (no second scrape target).

The standard library only: this runs inside vLLM's interpreter, not vsup's.
VSUP_HOOK_TEST_FD2=TITLE|TEXT[|COUNT] (tests and benches only) makes the
process titled TITLE write TEXT to fd 2 natively, from a thread.
"""

import ctypes
import json
import os
import signal
import socket
import sys
import threading

PR_SET_PDEATHSIG = 1
_kept = []  # this process's connections: closed only when it exits


def _connect(path: str, stream: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall((json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "stream": stream}) + "\n").encode())
    return sock


def _watch(sock: socket.socket) -> None:
    """Block until the supervisor's end closes; then this process must not outlive it."""
    try:
        while sock.recv(64):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _install(parent: int) -> None:
    path = os.environ.get("VSUP_HOOK_SOCKET")
    if not path:
        return
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if parent and os.getppid() != parent:  # the parent died before PDEATHSIG was set
        os.kill(os.getpid(), signal.SIGKILL)
    os.environ["VSUP_HOOK_PARENT"] = str(os.getpid())  # what this process's own children check
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    del _kept[:]
    try:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            sock = _connect(path, name)
            os.dup2(sock.fileno(), fd)
            _kept.append(sock)
    except OSError:
        os.kill(os.getpid(), signal.SIGKILL)  # the supervisor is gone: nothing may run untracked
    threading.Thread(target=_watch, args=(_kept[-1],), name="vsup-hook", daemon=True).start()


def _record_shared_memory() -> None:
    log = os.environ.get("VSUP_HOOK_SHM_LOG")
    if not log:
        return
    from multiprocessing import resource_tracker

    register = resource_tracker.register

    def recorded(name, rtype):
        try:
            with open(log, "a") as f:
                f.write(f"{rtype} {name}\n")
        except OSError:
            pass
        return register(name, rtype)

    resource_tracker.register = recorded


def _test_fd2() -> None:
    """VSUP_HOOK_TEST_FD2=TITLE|TEXT[|COUNT]: the process titled TITLE writes the line TEXT (COUNT times,
    default once) to fd 2 natively, from a thread."""
    title, _, rest = os.environ.get("VSUP_HOOK_TEST_FD2", "").partition("|")
    text, _, count = rest.partition("|")
    if not text:
        return

    def write_once_titled():
        import time

        for _ in range(1200):
            with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0].decode(errors="replace") == title:
                    data = f"{text}\n".encode() * int(count or 1)
                    while data:
                        data = data[os.write(2, data):]
                    return
            time.sleep(0.25)

    threading.Thread(target=write_once_titled, name="vsup-hook-test", daemon=True).start()


def _export_restarts() -> None:
    """On vLLM's own /metrics (its one API server, VSUP_HOOK_STATE_FILE set): `vsup_restarts_total{role}`,
    the trees vsup restarted by the role whose process died, read from state.json at scrape time."""
    state = os.environ.get("VSUP_HOOK_STATE_FILE")
    if not state:
        return
    try:
        from prometheus_client.core import REGISTRY, CounterMetricFamily
    except ImportError:
        return

    class Restarts:
        def collect(self):
            try:
                with open(state) as f:
                    by_role = json.load(f)["units"]["vllm"].get("by_role") or {}
            except (OSError, ValueError, KeyError, TypeError):
                by_role = {}
            family = CounterMetricFamily("vsup_restarts", "vLLM trees vsup restarted, by the role whose process "
                                         "died.", labels=["role"])
            for role in ("api-server", "engine-core", "worker", "coordinator", "helper"):
                family.add_metric([role], int(by_role.get(role, 0)))
            yield family

    REGISTRY.register(Restarts())


def _after_fork() -> None:
    _install(int(os.environ.get("VSUP_HOOK_PARENT", "0")))
    _test_fd2()


if os.environ.get("VSUP_HOOK_SOCKET"):
    if os.environ.get("VSUP_HOOK_PARENT") == os.environ.get("VSUP_SUPERVISOR_PID"):  # `vllm serve` itself
        _export_restarts()
    os.environ.pop("VSUP_HOOK_STATE_FILE", None)  # its children have no /metrics of their own
    _install(int(os.environ.get("VSUP_HOOK_PARENT", "0")))
    _record_shared_memory()
    _test_fd2()
    os.register_at_fork(after_in_child=_after_fork)
