"""What an API server reads of the supervisor: from its state.json (`--state-file`) the restarts per role
for /metrics and the DP ranks vsup gave up restarting, for /health; from its control socket
(`--supervisor-socket`) what each process of the tree last said it is busy with. The file is the
supervisor's, written whole on every change; the engine never imports vsup."""

from __future__ import annotations

import json
import re
import socket

_RANK_UNIT = re.compile(r"(?:engine-core|worker-group) dp(\d+)")


def read(state_file: str | None) -> dict:
    """The supervisor's state, or {} when there is none (yet)."""
    if not state_file:
        return {}
    try:
        with open(state_file) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def restarts_by_role(state: dict, roles) -> dict[str, int]:
    restarts = dict.fromkeys(roles, 0)
    for process in state.get("processes") or []:
        if process.get("role") in restarts:
            restarts[process["role"]] += int(process.get("restarts") or 0)
    return restarts


def incidents(state: dict) -> dict[tuple[str, str], int]:
    """{(role, cause): incidents since the supervisor started} (vsup incidents)."""
    counts = (state.get("incidents") or {}).get("counts") or {}
    return {tuple(key.split("/", 1)): int(n) for key, n in counts.items() if "/" in key}


def hung_ranks(state: dict) -> dict[int, str]:
    """{dp rank: why} for each rank that vsup is restarting because it hung (requests and no step for its
    --hang-timeout): until it is back, /health says it is down, so that no load balancer keeps sending to it."""
    hung = {}
    for name, unit in (state.get("units") or {}).items():
        match = _RANK_UNIT.fullmatch(name)
        if match and (unit or {}).get("state") in ("backoff", "starting") and \
                str((unit or {}).get("why") or "").startswith("hung"):
            hung[int(match.group(1))] = unit["why"]
    return hung


def failed_ranks(state: dict) -> dict[int, str]:
    """{dp rank: why} for each rank whose engine core or worker group vsup marked failed (past
    --max-restarts): it will not come back, where a rank that is down will."""
    failed = {}
    for name, unit in (state.get("units") or {}).items():
        match = _RANK_UNIT.fullmatch(name)
        if match and (unit or {}).get("state") == "failed":
            failed[int(match.group(1))] = f"vsup gave up restarting {name} after {unit.get('restarts', 0)} " \
                                          f"restarts (--max-restarts)"
    return failed


def loads(control_socket: str | None, timeout_s: float = 0.5) -> dict[str, dict]:
    """{process name: its last load report (role, busy shares, rates)}, asked of the supervisor now; {}
    when it does not answer within `timeout_s`."""
    if not control_socket:
        return {}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(control_socket)
            sock.sendall(b'{"cmd": "loads"}\n')
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
        found = json.loads(answer).get("loads")
    except (OSError, ValueError, AttributeError):
        return {}
    return found if isinstance(found, dict) else {}
