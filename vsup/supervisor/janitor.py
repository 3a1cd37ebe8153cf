"""`python -m vsup.supervisor.janitor RUN_DIR PID`: what a stock vLLM tree leaves when vsup itself is killed.

The supervisor (PID) starts it. The janitor waits on a pidfd of the supervisor until it
exits, however it exits; then waits (at most 5 s) until the tree's processes are gone,
removes the /dev/shm entries the tree made (listed in RUN_DIR/shm.txt; with --replicas,
RUN_DIR/rN/shm.txt for each) and its temporary dir, and exits. After a normal stop the
supervisor has done this already and the janitor finds nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import sys
import time
from pathlib import Path

from vsup import procfs, shm_sweep


def main(run_dir: str, supervisor: int) -> None:
    try:
        select.select([os.pidfd_open(supervisor)], [], [])  # readable once it has exited
    except ProcessLookupError:
        pass  # (gone already)
    path = Path(run_dir)
    try:
        pids = [p["pid"] for p in json.loads((path / "state.json").read_text())["processes"] if p.get("pid")]
    except (OSError, ValueError, KeyError, TypeError):
        pids = []
    deadline = time.monotonic() + 5
    while any(procfs.running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:  # a new supervisor of this deployment may have started meanwhile: what is listed now is its own
        lock = os.open(path / "supervisor.pid", os.O_RDONLY)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return
    shm_sweep.sweep_deployment(path)


if __name__ == "__main__":
    os.setsid()  # not in the tree's process group: a kill of the group must leave it to clean up
    main(sys.argv[1], int(sys.argv[2]))
