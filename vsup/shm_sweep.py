"""The /dev/shm entries and the temporary dir a stock vLLM tree made, and removing them when it is gone.

Two sources name them in RUN_DIR/shm.txt, one `KIND NAME` a line: the start-up hook
(every segment and semaphore multiprocessing registers) and the supervisor, which
reads the /dev/shm files each process of the tree has mapped (vLLM's CPU
communicators create theirs in C++, past multiprocessing).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SHM = Path("/dev/shm")
LIST = "shm.txt"


TMPDIR_NOTE = "tmpdir"


def make_tmp_dir(run_dir: Path) -> Path:
    """A TMPDIR of the tree's own (0700), so that vLLM's rendezvous files and ipc sockets go where the sweep
    finds them. Short, under the system's temp dir: an ipc:// path in it must fit 107 bytes, which one in a
    run dir may not. Its path is noted in the run dir."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="vsup-vllm-"))
    (run_dir / TMPDIR_NOTE).write_text(str(path))
    return path


def record(run_dir: Path, names: set[str]) -> None:
    if names:
        with open(run_dir / LIST, "a") as f:
            f.writelines(f"mapped {name}\n" for name in sorted(names))


def entries(run_dir: Path) -> set[str]:
    """The /dev/shm file names listed: multiprocessing's `/psm_x` is psm_x, a semaphore `/mp-x` is sem.mp-x."""
    try:
        lines = (run_dir / LIST).read_text().splitlines()
    except OSError:
        return set()
    names = set()
    for line in lines:
        kind, _, name = line.partition(" ")
        name = name.lstrip("/")
        if name and "/" not in name:
            names.add(f"sem.{name}" if kind == "semaphore" else name)
    return names


def sweep(run_dir: Path) -> list[str]:
    """Remove every listed entry that is still there, and the tree's TMPDIR; returns what was removed."""
    removed = []
    for name in sorted(entries(run_dir)):
        try:
            (SHM / name).unlink()
            removed.append(name)
        except OSError:
            pass
    for note in (LIST, TMPDIR_NOTE):
        try:
            if note == TMPDIR_NOTE:
                shutil.rmtree((run_dir / note).read_text().strip(), ignore_errors=True)
            os.unlink(run_dir / note)
        except OSError:
            pass
    return removed


def sweep_deployment(run_dir: Path) -> list[str]:
    """sweep() for each tree of a deployment: its run dir, and one dir per replica (rN) with --replicas."""
    return [name for tree_dir in [run_dir, *sorted(run_dir.glob("r[0-9]*"))] for name in sweep(tree_dir)]
