"""Byte sizes as people write them (`4GiB`) and read them (`1.5 GiB`). Pure; `vsup ps` imports it alone."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '2G' or a plain byte count -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write it like 4GiB, 512MiB or 1000000000")
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(size):
        raise ValueError(f"{text!r} is too large a size; write it like 4GiB, 512MiB or 1000000000")
    return int(size)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
