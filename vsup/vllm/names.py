"""vLLM's names for its processes and its log lines, read into vsup's. Pure.

vLLM titles its processes `VLLM::EngineCore_DP1`, `VLLM::Worker_DP0_PP1_TP1` and so
on (setproctitle; a suffix only where that size is above 1), and prefixes every line
that Python logs with `(Name pid=N) `. vsup names the same processes
`engine-core dp1` and `worker dp0 pp1 tp1`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vsup.topology import API_SERVER, COORDINATOR, ENGINE_CORE, WORKER

HELPER = "helper"
TITLE_PREFIX = "VLLM::"

_RANKS = re.compile(r"_(DP|PP|PCP|TP|DCP|EP)(\d+)")
_PREFIX = re.compile(r"^(?:\x1b\[[\d;]*m)?\((?P<name>[\w-]+) pid=(?P<pid>\d+)\)(?:\x1b\[[\d;]*m)? ?")
_RECORD = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d "
                     r"\[(?P<source>[^\]]+)\] ?(?P<message>.*)$")
_GLOG = re.compile(r"^\[?(?P<level>[WEIF])\d{4} ")  # torch's C++ warnings: [W1201 08:49:03 ...]
_UVICORN = re.compile(r"^(?P<level>INFO|WARNING|ERROR|CRITICAL|DEBUG):\s+(?P<message>.*)$")
_PROGRESS = re.compile(r"\d+/\d+ \[[\d:<?]+|\d+(\.\d+)?(it/s|s/it)\]")
GLOG_LEVELS = {"W": "warning", "E": "error", "I": "info", "F": "critical"}


@dataclass(frozen=True)
class Role:
    """Who a vLLM process is, in vsup's terms: the role and whichever ranks the name gives."""

    role: str
    a: int | None = None
    dp: int | None = None
    pp: int | None = None
    tp: int | None = None
    settled: bool = True  # False for a worker titled before its parallel groups exist


def role_of_name(name: str) -> Role | None:
    """`EngineCore_DP1`, `Worker_TP1`, `APIServer_2`, `ApiServer_2`, `DPCoordinator` -> its role and ranks."""
    base, _, rest = name.partition("_")
    ranks = {kind: int(n) for kind, n in _RANKS.findall("_" + rest)} if rest else {}
    if base == "EngineCore":
        return Role(ENGINE_CORE, dp=ranks.get("DP", 0))
    if base in ("Worker", "VllmWorker"):
        if base == "VllmWorker" or not ranks and not rest:  # before its groups exist: ranks unknown
            return Role(WORKER, settled=False)
        return Role(WORKER, dp=ranks.get("DP", 0), pp=ranks.get("PP", 0), tp=ranks.get("TP", 0))
    if base.lower() == "apiserver":
        return Role(API_SERVER, a=int(rest) if rest.isdigit() else 0)
    if base == "DPCoordinator":
        return Role(COORDINATOR)
    return None


def role_of_title(cmdline: list[str]) -> Role | None:
    """A process's role from its command line: vLLM's title, or multiprocessing's resource tracker."""
    text = " ".join(cmdline)
    if text.startswith(TITLE_PREFIX):
        return role_of_name(text[len(TITLE_PREFIX):].split()[0] if text[len(TITLE_PREFIX):] else "")
    if "multiprocessing.resource_tracker" in text:
        return Role(HELPER)
    return None


@dataclass(frozen=True)
class Line:
    """One output line of a vLLM process, parsed: its prefix (if any), level, message and source."""

    level: str | None
    message: str
    source: str | None = None
    prefix_name: str | None = None
    prefix_pid: int | None = None


def parse_line(line: str) -> Line:
    """`(EngineCore pid=7) INFO 12-01 08:49:16 [core.py:133] msg`, uvicorn's `INFO:     ...`, torch's
    `[W1201 ...]`, or anything else (a traceback line, a progress bar, native output)."""
    name = pid = None
    line = line.lstrip("\r")
    match = _PREFIX.match(line)
    if match:
        name, pid = match["name"], int(match["pid"])
        line = line[match.end():]
    record = _RECORD.match(line)
    if record:
        return Line(record["level"].lower(), record["message"], record["source"], name, pid)
    uvicorn = _UVICORN.match(line)
    if uvicorn:
        return Line(uvicorn["level"].lower(), uvicorn["message"], None, name, pid)
    glog = _GLOG.match(line)
    if glog:
        return Line(GLOG_LEVELS[glog["level"]], line, None, name, pid)
    if _PROGRESS.search(line):  # a progress bar (tqdm), on stderr
        return Line("info", line, None, name, pid)
    if "Warning:" in line or "warnings.warn" in line:
        return Line("warning", line, None, name, pid)
    return Line(None, line, None, name, pid)  # the caller's stream decides: stderr is an error, stdout info


def continues(line: str) -> bool:
    """An indented line goes on the line before it: a traceback's frames, a warning's source line."""
    return line[:1] in (" ", "\t")


def started_by_multiprocessing(cmdline: str) -> bool:
    """Whether a process not yet titled is one that multiprocessing started (spawn or forkserver: vLLM's
    engine cores and workers), not a command vLLM runs."""
    return "multiprocessing" in cmdline
