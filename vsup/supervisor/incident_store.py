"""Incidents on disk: one JSON file each in the run dir's incidents/ (0700; files 0600), numbered on from the
last one there, so they outlive a restart of vsup itself and the deployment's stop, and `vsup incidents`
reads them with no supervisor running. Bounded: the last MAX_INCIDENTS, at most MAX_BYTES in all (the
oldest go first). Request ids and token counts only, never a prompt's text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MAX_INCIDENTS = 100
MAX_BYTES = 20 * 2**20
DIR = "incidents"


def directory(run_dir: Path) -> Path:
    return Path(run_dir) / DIR


def _numbered(folder: Path) -> list[tuple[int, Path]]:
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        stem, dot, ext = name.partition(".")
        if ext == "json" and stem.isdigit():
            found.append((int(stem), folder / name))
    return sorted(found)


def next_id(run_dir: Path) -> str:
    numbered = _numbered(directory(run_dir))
    return str(numbered[-1][0] + 1 if numbered else 1)


def write(run_dir: Path, record: dict) -> None:
    """Write (or rewrite) one incident, atomically, then drop the oldest beyond the bounds."""
    folder = directory(run_dir)
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"{record['id']}.json"
    tmp = folder / f".{record['id']}.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)
    prune(folder)


def prune(folder: Path) -> list[str]:
    """Remove the oldest incidents beyond MAX_INCIDENTS or MAX_BYTES; their ids."""
    numbered = _numbered(folder)
    sizes = {path: path.stat().st_size for _, path in numbered}
    removed = []
    while numbered and (len(numbered) > MAX_INCIDENTS or sum(sizes[p] for _, p in numbered) > MAX_BYTES) \
            and len(numbered) > 1:
        number, path = numbered.pop(0)
        path.unlink(missing_ok=True)
        removed.append(str(number))
    return removed


def load_all(run_dir: Path) -> list[dict]:
    """Every incident kept, newest first (a file that does not read is left out)."""
    out = []
    for _, path in reversed(_numbered(directory(run_dir))):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def load(run_dir: Path, incident_id: str) -> dict | None:
    try:
        return json.loads((directory(run_dir) / f"{int(incident_id)}.json").read_text())
    except (OSError, ValueError):
        return None
