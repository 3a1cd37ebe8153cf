"""vsup's start-up hook in every process of a stock vLLM tree.

`vsup serve --engine vllm` puts this directory first on the PYTHONPATH of
`vllm serve`, so Python imports this module at start-up in every process of the
tree that vLLM spawns; `os.register_at_fork` covers the ones it forks. It does
nothing unless VSUP_HOOK_SOCKET is set. In each process it:

- points fds 1 and 2 at two connections to the supervisor's hook socket, each
  opened by one JSON line ({"pid", "ppid", "stream", "replica"}): the supervisor tags every
  line, native writes and tracebacks included, with the process that wrote it;
- sets PR_SET_PDEATHSIG (SIGKILL), and ends at once when its parent already
  went before that took hold;
- ends itself when the supervisor goes (its end of the connection closes),
  whatever became of the parents in between;
- appends each shared-memory segment and semaphore that multiprocessing
  registers to VSUP_HOOK_SHM_LOG, so that what a killed tree leaves in /dev/shm
  can be found and removed;
- appends each child it reaps through os.waitpid (multiprocessing's join and
  poll), with its wait status, to VSUP_HOOK_REAP_LOG: the supervisor never sees
  the end of a process that its parent waited for, only that it is gone;

The standard library only: this runs inside vLLM's interpreter, not vsup's.
For tests and benches only: VSUP_HOOK_TEST_FD2=TITLE|TEXT[|COUNT] makes the
process titled TITLE write TEXT to fd 2 natively, from a thread; and
VSUP_HOOK_TEST_POISON=ID,ID,... makes an engine core kill itself (SIGKILL)
when it is given a request whose prompt holds those token IDs in a row.
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
    hello = {"pid": os.getpid(), "ppid": os.getppid(), "stream": stream,
             "replica": int(os.environ.get("VSUP_HOOK_REPLICA") or 0)}
    sock.sendall((json.dumps(hello) + "\n").encode())
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


def _record_reaped() -> None:
    log = os.environ.get("VSUP_HOOK_REAP_LOG")
    if not log:
        return
    waitpid = os.waitpid

    def recorded(*args):
        pid, status = waitpid(*args)
        if pid > 0:
            try:
                with open(log, "a") as f:
                    f.write(f"{pid} {status}\n")
            except OSError:
                pass
        return pid, status

    os.waitpid = recorded


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


def _test_poison() -> None:
    marker = [int(x) for x in os.environ.get("VSUP_HOOK_TEST_POISON", "").split(",") if x.strip()]
    if not marker:
        return

    def holds(prompt) -> bool:
        prompt = list(prompt or ())
        return any(prompt[i:i + len(marker)] == marker for i in range(len(prompt) - len(marker) + 1))

    def patch_when_imported():
        import time

        while True:
            core = sys.modules.get("vllm.v1.engine.core")
            engine_core = getattr(core, "EngineCore", None)
            if engine_core is not None and hasattr(engine_core, "add_request"):
                original = engine_core.add_request

                def add_request(self, request, *args, **kwargs):
                    if holds(getattr(request, "prompt_token_ids", None)):
                        os.kill(os.getpid(), signal.SIGKILL)
                    return original(self, request, *args, **kwargs)

                engine_core.add_request = add_request
                return
            time.sleep(0.05)

    threading.Thread(target=patch_when_imported, name="vsup-hook-poison", daemon=True).start()


def _after_fork() -> None:
    _install(int(os.environ.get("VSUP_HOOK_PARENT", "0")))
    _test_fd2()
    _test_poison()


if os.environ.get("VSUP_HOOK_SOCKET"):
    _install(int(os.environ.get("VSUP_HOOK_PARENT", "0")))
    _record_shared_memory()
    _record_reaped()
    _test_fd2()
    _test_poison()
    os.register_at_fork(after_in_child=_after_fork)
