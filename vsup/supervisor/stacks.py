"""The Python stacks of live processes, for an incident: `py-spy dump` of each, all at once, under a deadline.

py-spy reads a process's memory from outside (`--nonblocking`: it does not stop the process, so a stopped
or hung one is read as well, and nothing waits on it); it needs ptrace rights over it (root, or the
capability SYS_PTRACE, which `plan --k8s` gives the pod). What does not answer within the deadline is
killed and said so; each text is cut at MAX_BYTES.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

DEADLINE_S = 3.0
MAX_BYTES = 64 * 1024


def py_spy() -> str | None:
    """py-spy next to this interpreter (vsup's venv), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def take(pids: dict[str, int], deadline_s: float = DEADLINE_S) -> tuple[dict[str, str], float]:
    """({process name: its stacks, or why there are none}, seconds it took)."""
    started = time.monotonic()
    tool = py_spy()
    if not pids:
        return {}, 0.0
    if tool is None:
        return {name: "no stacks: py-spy is not installed" for name in pids}, 0.0
    running = {name: subprocess.Popen([tool, "dump", "--nonblocking", "--pid", str(pid)], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
               for name, pid in pids.items()}
    found = {}
    for name, proc in running.items():
        try:
            out, _ = proc.communicate(timeout=max(0.0, deadline_s - (time.monotonic() - started)))
            text = out.decode(errors="replace")
            found[name] = text if proc.returncode == 0 else f"no stacks (py-spy: {text.strip()[-300:]})"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            found[name] = f"no stacks: py-spy did not answer within {deadline_s:g} s"
    return {name: _cut(text) for name, text in found.items()}, round(time.monotonic() - started, 3)


def _cut(text: str) -> str:
    data = text.encode()
    return text if len(data) <= MAX_BYTES else data[:MAX_BYTES].decode(errors="ignore") + "\n[cut at 64 KiB]"
