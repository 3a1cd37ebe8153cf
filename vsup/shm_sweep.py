"""The /dev/shm entries and temporary files a stock vLLM tree made, and removing them when it is gone.

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


def tmp_dir(run_dir: Path) -> Path:
    """The tree's TMPDIR: vLLM's rendezvous files (vllm_dist_*) go there, not to /tmp."""
    return run_dir / "tmp"


def mapped(pid: int) -> set[str]:
    """The /dev/shm entries that process `pid` has mapped now."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split("/dev/shm/", 1)[1].rstrip("\n").removesuffix(" (deleted)")
                    for line in f if "/dev/shm/" in line}
    except OSError:
        return set()


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
    try:
        os.unlink(run_dir / LIST)
    except OSError:
        pass
    shutil.rmtree(tmp_dir(run_dir), ignore_errors=True)
    return removed
