"""Reading vsup.jsonl back: filters by role, ranks, level and time; rotated files; following."""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from vsup.errors import UsageError

LEVELS = ("debug", "info", "warning", "error", "critical")


def make_filter(role, dp, pp, tp, level, since: datetime | None, replica: int | None = None):
    minimum = LEVELS.index(level) if level else 0

    def match(r: dict) -> bool:
        if role is not None and r.get("role") != role:
            return False
        for key, want in (("r", replica), ("dp", dp), ("pp", pp), ("tp", tp)):
            if want is not None and r.get(key) != want:
                return False
        if minimum and (r.get("level") not in LEVELS or LEVELS.index(r["level"]) < minimum):
            return False
        return since is None or _when(r) >= since

    return match


def parse_since(text: str) -> datetime:
    """`30s`, `10m`, `2h`, `1d` ago, or an ISO 8601 time."""
    m = re.fullmatch(r"(\d+)([smhd])", text)
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
        try:
            return datetime.now(timezone.utc) - timedelta(**{unit: int(m.group(1))})
        except OverflowError:  # before the year 1
            raise UsageError(f"--since {text!r} reaches back past the year 1; give a shorter time") from None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"--since {text!r}: write it like 30s, 10m, 2h, 1d or 2026-11-29T10:00:00") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def _when(record: dict) -> datetime:
    try:
        return datetime.fromisoformat(str(record.get("ts")).replace("Z", "+00:00"))
    except ValueError:
        return datetime.min.replace(tzinfo=timezone.utc)


def read_records(path: Path):
    """Every record, oldest first, through the rotated files (vsup.jsonl.5 ... .1, then vsup.jsonl)."""
    rotated = sorted(path.parent.glob(path.name + ".*"), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0)
    for file in [*rotated, path]:
        if file.exists():
            with open(file, errors="replace") as f:
                for line in f:
                    record = _parse(line)
                    if record is not None:
                        yield record


def tail(path: Path):
    """Records appended after now, following rotation, until interrupted."""
    f = open(path, errors="replace")
    f.seek(0, 2)
    try:
        while True:
            line = f.readline()
            if line:
                record = _parse(line)
                if record is not None:
                    yield record
                continue
            if path.exists() and path.stat().st_ino != _inode(f):  # rotated: read the new file
                f.close()
                f = open(path, errors="replace")
                continue
            time.sleep(0.2)
    except KeyboardInterrupt:
        return
    finally:
        f.close()


def _inode(f) -> int:
    return os.fstat(f.fileno()).st_ino


def _parse(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
