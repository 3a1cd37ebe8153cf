"""The janitor of a stock vLLM deployment (vsup/supervisor/janitor.py) over real processes: it sweeps
what the trees listed once their supervisor is gone, killed with -9 included, and never while it lives.
A stand-in holds the deployment's lock as the supervisor does; a /dev/shm file stands for vLLM's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.polling import wait_for
from vsup import shm_sweep

HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def deployment(tmp_path):
    """A run dir with replica 1's tree listing one /dev/shm entry, and a stand-in supervisor holding its lock."""
    entry = Path("/dev/shm") / f"psm_test_{uuid.uuid4().hex[:8]}"
    entry.write_bytes(b"x")
    tree = tmp_path / "r1"
    tree.mkdir()
    (tree / shm_sweep.LIST).write_text(f"shared_memory /{entry.name}\n")
    (tmp_path / "state.json").write_text(json.dumps({"processes": []}))
    supervisor = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path / "supervisor.pid")],
                                  stdout=subprocess.PIPE, text=True)
    assert supervisor.stdout.readline() == "locked\n"
    janitor = subprocess.Popen([sys.executable, "-m", "vsup.supervisor.janitor", str(tmp_path), str(supervisor.pid)])
    wait_for(lambda: watching(janitor.pid), timeout=30, what="the janitor waiting on the supervisor's pidfd")
    yield tmp_path, entry, supervisor, janitor
    for proc in (supervisor, janitor):
        proc.kill()
        proc.wait()
    entry.unlink(missing_ok=True)


def watching(pid: int) -> bool:
    """The process holds a pidfd: the janitor has begun its wait for the supervisor's end."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any("pidfd" in os.readlink(fd) for fd in fds.iterdir())
    except OSError:
        return False


def test_a_killed_supervisors_listed_entries_go_and_the_janitor_exits(deployment):
    run_dir, entry, supervisor, janitor = deployment
    # the janitor waits (the fixture saw its pidfd), and nothing goes while the supervisor lives
    assert entry.exists() and janitor.poll() is None
    os.kill(supervisor.pid, signal.SIGKILL)
    supervisor.wait()
    assert janitor.wait(timeout=10) == 0
    assert not entry.exists() and not (run_dir / "r1" / shm_sweep.LIST).exists()


def test_a_new_supervisor_that_took_the_deployment_keeps_what_is_listed(deployment):
    """The janitor waits up to 5 s for the tree's processes (state.json) after the supervisor's end; a new
    supervisor of the deployment that takes the lock meanwhile owns what is listed then: nothing goes."""
    run_dir, entry, supervisor, janitor = deployment
    straggler = subprocess.Popen(["sleep", "60"])
    successor = None
    (run_dir / "state.json").write_text(json.dumps({"processes": [{"pid": straggler.pid}]}))
    try:
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait()
        successor = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir / "supervisor.pid")],
                                     stdout=subprocess.PIPE, text=True)
        assert successor.stdout.readline() == "locked\n"
        assert janitor.poll() is None  # still waiting for the straggler
        straggler.kill()
        assert janitor.wait(timeout=10) == 0
        assert entry.exists() and (run_dir / "r1" / shm_sweep.LIST).exists()
    finally:
        for proc in filter(None, (straggler, successor)):
            proc.kill()
            proc.wait()
