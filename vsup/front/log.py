"""The front's log: one JSON line on stdout, which the supervisor tags as the front's."""

from __future__ import annotations

import json


def log(event: str, level: str = "info", **fields) -> None:
    print(json.dumps({"event": event, "level": level, **fields}, default=str), flush=True)
