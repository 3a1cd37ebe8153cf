"""Tag a child's output line with who wrote it, and render records for the console. Pure.

The tag comes from the pipe the line came out of, never from the child's own
words: a line from C code or a traceback is tagged like any JSON line.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

# the child's own copies of these are replaced by the pipe's tag
TAG_FIELDS = ("name", "role", "a", "dp", "pp", "tp", "pid")
LEVELS = ("debug", "info", "warning", "error", "critical")
LOAD_LOGGER = "vsup.load"  # a child's load reports (engine/load.py): kept for `vsup ps`, never written to the logs
COLORS = {"api-server": 36, "engine-core": 35, "worker": 33, "coordinator": 34, "supervisor": 32}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def is_load_report(record: dict) -> bool:
    """Whether a tagged record is a child's load report rather than a log line."""
    return record.get("event") == "load" and record.get("logger") == LOAD_LOGGER and record.get("stream") == "stdout"


def tag_line(line: str, stream: str, tag: dict, ts: str | None = None) -> dict:
    """One record of vsup.jsonl: ts, level, name, role, ranks, pid, stream, event, and the child's extras.
    `ts`: when the line arrived (now, if not given), for a line that does not say when it was written."""
    parsed = None
    if line.lstrip().startswith("{"):  # (as tag_json_lines reads it)
        try:
            parsed = _json_decoder().decode(line)
        except ValueError:  # (msgspec's DecodeError is one)
            parsed = None
    if not (isinstance(parsed, dict) and "event" in parsed):
        return {"ts": ts or now_iso(), "level": "error" if stream == "stderr" else "info", **tag, "stream": stream,
                "event": line}
    return _from_json(parsed, stream, tag, ts)


def tag_json_lines(data: bytes, stream: str, tag: dict, ts: str) -> list[dict] | None:
    """The records of whole lines (`data` ends with a newline), each a JSON object with an event, as
    tag_line makes them, decoded in one call; None when any line is not such an object (then tag them
    one by one). Blank lines give no record, as with tag_line's caller."""
    try:
        parsed = _json_decoder().decode_lines(data)
    except ValueError:
        return None
    if len(parsed) != data.count(b"\n"):  # a blank line, or two objects on one line: leave it to tag_line
        return None
    if not all(type(p) is dict and "event" in p for p in parsed):
        return None
    return [_from_json(p, stream, tag, ts) for p in parsed]


def _from_json(parsed: dict, stream: str, tag: dict, ts: str | None) -> dict:
    record = {"ts": parsed.pop("timestamp", None) or ts or now_iso(), "level": str(parsed.pop("level", "info")).lower(),
              **tag, "stream": stream, "event": str(parsed.pop("event"))}
    for key, value in parsed.items():
        if key not in _TAGGED and key not in record:
            record[key] = value
    return record


_TAGGED = frozenset(TAG_FIELDS)
_decoder = None


def _json_decoder():
    """msgspec's JSON decoder (6x json.loads here), imported on the supervisor's first line, not by
    `vsup logs`, which renders only."""
    global _decoder
    if _decoder is None:
        import msgspec

        _decoder = msgspec.json.Decoder()
    return _decoder


def supervisor_record(event: str, level: str = "info", **fields) -> dict:
    """A line the supervisor itself writes, in the same shape as a child's."""
    return {"ts": now_iso(), "level": level, "name": "supervisor", "role": "supervisor", "pid": None,
            "stream": "supervisor", "event": event, **fields}


def render(record: dict, width: int, color: bool) -> str:
    """`name | event key=value ...` with the name padded to `width`; a traceback follows, indented."""
    name = record.get("name") or record.get("role") or "?"
    prefix = f"{name:<{width}} |"
    if color:
        prefix = f"\x1b[{COLORS.get(record.get('role'), 37)}m{prefix}\x1b[0m"
    skip = {"ts", "level", "stream", "event", "exception", "logger", *TAG_FIELDS}  # (logger: JSON's, for queries)
    extras = " ".join(f"{k}={_short(v)}" for k, v in record.items() if k not in skip and v is not None)
    level = record.get("level")
    marker = f"{level.upper()} " if level in ("warning", "error", "critical") and record.get("stream") != "stderr" else ""
    lines = [f"{prefix} {marker}{record.get('event')}{' ' + extras if extras else ''}"]
    for line in str(record.get("exception") or "").splitlines():
        lines.append(f"{prefix}   {line}")
    return "\n".join(lines)


def _short(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."
