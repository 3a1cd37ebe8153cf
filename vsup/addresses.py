"""Where the processes of one deployment meet: socket paths and shared-memory names.

All of them live in the deployment's run dir (mode 0700) or carry its name,
so two deployments on one host never collide. Pure: strings in, strings out.
"""

from __future__ import annotations

import os
import re

SHM_PREFIX = "vsup-"


def api_server_engine_socket(run_dir: str, a: int) -> str:
    """The ROUTER an API server binds and every engine core connects to."""
    return f"ipc://{os.path.join(run_dir, f'a{a}-engines.sock')}"


def core_worker_socket(run_dir: str, dp: int) -> str:
    """The ROUTER an engine core binds and its workers connect to."""
    return f"ipc://{os.path.join(run_dir, f'dp{dp}-workers.sock')}"


def core_control_socket(run_dir: str, dp: int) -> str:
    """The PULL socket where the supervisor tells an engine core its workers died."""
    return f"ipc://{os.path.join(run_dir, f'dp{dp}-control.sock')}"


def ring_wakeup_socket(run_dir: str, dp: int) -> str:
    return f"ipc://{os.path.join(run_dir, f'dp{dp}-wakeup.sock')}"


def ring_prefix(name: str, dp: int) -> str:
    """/dev/shm name prefix of an engine core's step ring; the supervisor removes leftovers by it."""
    return f"{SHM_PREFIX}{name}-dp{dp}"


def ring_pattern(name: str) -> str:
    """A regex matching every ring segment of deployment `name` (prefix plus the ring's hex nonce)."""
    return re.escape(f"{SHM_PREFIX}{name}-dp") + r"\d+-[0-9a-f]+"


def dist_init_method(run_dir: str, dp: int, generation: int) -> str:
    """torch.distributed rendezvous of one worker group; a new file for every generation."""
    return f"file://{os.path.join(run_dir, f'dp{dp}-dist-{generation}')}"


def coordinator_input_socket(run_dir: str) -> str:
    """Where engine cores push their load to the coordinator."""
    return f"ipc://{os.path.join(run_dir, 'coordinator-in.sock')}"


def coordinator_output_socket(run_dir: str) -> str:
    """Where API servers subscribe to every rank's load."""
    return f"ipc://{os.path.join(run_dir, 'coordinator-out.sock')}"


def state_file(run_dir: str) -> str:
    """The supervisor's state.json, which API servers read for their restart counts."""
    return os.path.join(run_dir, "state.json")


def control_socket(run_dir: str) -> str:
    """The supervisor's own control socket (a Unix stream socket, JSON lines)."""
    return os.path.join(run_dir, "control.sock")
