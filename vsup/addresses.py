"""Where the processes of one deployment meet: socket paths and shared-memory names.

All of them live in the deployment's run dir (mode 0700) or carry its name,
so two deployments on one host never collide. A deployment that spans nodes
(`--dp-address HOST:PORT`) puts what other nodes reach on tcp://, one port
each from PORT up (see `DP_PORTS`), CurveZMQ-encrypted (engine/cluster.py);
a TP x PP group that spans nodes (`--nnodes`) meets at --master-port and
the next two ports (`MASTER_PORTS`).
Pure: strings in, strings out.
"""

from __future__ import annotations

import os
import re

SHM_PREFIX = "vsup-"

# what the head node binds for other nodes, as offsets from --dp-address's port
DP_PORTS = {"coordinator-in": 0, "coordinator-out": 1, "coordinator-waves": 2, "api-server a0": 3}
# what node 0 binds for a TP x PP group that spans nodes (--nnodes), as offsets from --master-port
MASTER_PORTS = {"torch-distributed": 0, "core-workers": 1, "ring-remote": 2}


def split_host_port(address: str) -> tuple[str, int]:
    """'HOST:PORT' (or '[V6]:PORT') -> (host, port); ValueError saying what is wrong."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port from 1 to 65535, got {address!r}")
    return host, int(port)


def _tcp(dp_address: str, offset: int) -> str:
    host, port = split_host_port(dp_address)
    return f"tcp://{'[' + host + ']' if ':' in host else host}:{port + offset}"


def api_server_engine_socket(run_dir: str, a: int, dp_address: str | None = None) -> str:
    """The ROUTER an API server binds and every engine core connects to."""
    if dp_address:
        return _tcp(dp_address, DP_PORTS["api-server a0"] + a)
    return f"ipc://{os.path.join(run_dir, f'a{a}-engines.sock')}"


def core_worker_socket(run_dir: str, dp: int, master: str | None = None) -> str:
    """The ROUTER an engine core binds and its workers connect to (at --master-port + 1 when the
    group spans nodes: `master` is 'HOST:PORT')."""
    if master:
        return _tcp(master, MASTER_PORTS["core-workers"])
    return f"ipc://{os.path.join(run_dir, f'dp{dp}-workers.sock')}"


def core_control_socket(run_dir: str, dp: int) -> str:
    """The PULL socket where the supervisor tells an engine core its workers died."""
    return f"ipc://{os.path.join(run_dir, f'dp{dp}-control.sock')}"


def ring_wakeup_socket(run_dir: str, dp: int) -> str:
    return f"ipc://{os.path.join(run_dir, f'dp{dp}-wakeup.sock')}"


def ring_prefix(name: str, dp: int) -> str:
    """/dev/shm name prefix of an engine core's step ring."""
    return f"{rings_prefix(name)}{dp}"


def rings_prefix(name: str) -> str:
    """/dev/shm name prefix of every step ring of deployment `name`."""
    return f"{SHM_PREFIX}{name}-dp"


def is_ring_of(name: str, entry: str) -> bool:
    """Whether /dev/shm entry `entry` is a step ring of deployment `name`: its prefix, a DP rank and the
    writer's hex nonce (the prefix alone would take in the rings of a deployment named `name`-dp3 too)."""
    return re.fullmatch(rf"{re.escape(rings_prefix(name))}\d+-[0-9a-f]+", entry) is not None


def ring_remote_socket(master: str) -> str:
    """Where a group spanning nodes sends each step to its workers on other nodes."""
    return _tcp(master, MASTER_PORTS["ring-remote"])


def dist_init_method(run_dir: str, dp: int, generation: int, master: str | None = None) -> str:
    """torch.distributed rendezvous of one worker group; a new file for every generation (or node 0's
    TCP store at --master-port when the group spans nodes)."""
    if master:
        return _tcp(master, MASTER_PORTS["torch-distributed"])
    return f"file://{os.path.join(run_dir, f'dp{dp}-dist-{generation}')}"


def coordinator_input_socket(run_dir: str, dp_address: str | None = None) -> str:
    """Where engine cores push their load (and, with --dp-lockstep, their steps) to the coordinator."""
    if dp_address:
        return _tcp(dp_address, DP_PORTS["coordinator-in"])
    return f"ipc://{os.path.join(run_dir, 'coordinator-in.sock')}"


def coordinator_output_socket(run_dir: str, dp_address: str | None = None) -> str:
    """Where API servers subscribe to every rank's load."""
    if dp_address:
        return _tcp(dp_address, DP_PORTS["coordinator-out"])
    return f"ipc://{os.path.join(run_dir, 'coordinator-out.sock')}"


def coordinator_wave_socket(run_dir: str, dp_address: str | None = None) -> str:
    """Where engine cores subscribe to the coordinator's wave messages (--dp-lockstep)."""
    if dp_address:
        return _tcp(dp_address, DP_PORTS["coordinator-waves"])
    return f"ipc://{os.path.join(run_dir, 'coordinator-waves.sock')}"


def state_file(run_dir: str) -> str:
    """The supervisor's state.json, which API servers read for their restart counts."""
    return os.path.join(run_dir, "state.json")


def metrics_dir(run_dir: str) -> str:
    """Where the API servers keep their Prometheus counters and histograms, one file per process, so that
    /metrics sums them over every API server, those restarted included (prometheus_client's multiprocess
    mode); emptied when the supervisor starts."""
    return os.path.join(run_dir, "metrics")


def control_socket(run_dir: str) -> str:
    """The supervisor's own control socket (a Unix stream socket, JSON lines)."""
    return os.path.join(run_dir, "control.sock")


def replica_dir(run_dir: str, r: int | None) -> str:
    """What one stock vLLM tree keeps apart from the others (--replicas): the run dir itself when it is the
    only one, else `rN/` in it."""
    return run_dir if r is None else os.path.join(run_dir, f"r{r}")


def vllm_socket(run_dir: str, r: int | None) -> str:
    """The Unix socket where a stock vLLM tree serves, behind vsup's front (`vllm serve --uds`): nothing
    but the front and the supervisor, which can enter the 0700 run dir, reaches it, and no port is taken."""
    return os.path.join(replica_dir(run_dir, r), "vllm.sock")
