"""The messages between vsup's own processes, as msgspec structs sent as JSON lines: a request on the
control socket, the hello that opens each connection of the vLLM hook, and what the supervisor tells
the front of each tree on the front's stdin. Every reader decodes with `decode`, and drops and logs what
does not fit. (The hook inside vLLM's processes writes its hello with the standard library only: the
struct is the reading side.)"""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec


class ControlRequest(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """`vsup ps`, `stop`, `restart` (and the engine's API servers, for `loads`) to the supervisor."""

    cmd: Literal["ps", "loads", "stop", "restart"]
    role: str | None = None
    dp: int | None = None
    replica: int | None = None
    rolling: bool = False
    now: bool = False


class Hello(msgspec.Struct):
    """The first line of each connection of the hook: whose lines follow, on which stream."""

    pid: int
    stream: Literal["stdout", "stderr"]
    ppid: int = 0
    replica: int = 0


class TreeNews(msgspec.Struct, omit_defaults=True):
    """The supervisor to the front: where one tree stands now, and the restarts so far by role."""

    replica: int
    gen: int
    up: bool
    stopping: bool = False
    restarts: dict[str, int] = {}
    incidents: dict[str, int] = {}  # "role/cause" -> incidents since the supervisor started


T = TypeVar("T")


def decode(line: bytes | str, kind: type[T]) -> T:
    """The struct of one JSON line; raises ValueError (msgspec's errors are ValueErrors) saying what is wrong."""
    return msgspec.json.decode(line, type=kind)


def encode_line(message: msgspec.Struct) -> bytes:
    return msgspec.json.encode(message) + b"\n"
