"""A pod's place in its LeaderWorkerSet group, from the variables LWS's webhook injects into every container,
turned into the parallel flags `vsup serve` would take on that node. Pure: the environment comes in.

The leader (LWS_WORKER_INDEX 0) and the workers run the same `vsup serve` flags (a worker may add
`--headless`); vsup fills in what differs:

- one TP x PP group across the pods (`--nnodes N`, N = LWS_GROUP_SIZE): `--node-rank` is the pod's index,
  `--headless` every pod but the leader, `--master-addr` the leader's address;
- data-parallel ranks across the pods (`-dp D --dp-size-local L`, D / L = LWS_GROUP_SIZE): pod i runs ranks
  i*L .. i*L+L-1 (`--dp-start-rank`), every pod but the leader `--headless`, `--dp-address` the leader's
  address at DP_PORT unless given.

A flag that contradicts the group (a --node-rank that is not the index, a size that is not the group's) is
refused, naming both.
"""

from __future__ import annotations

from collections.abc import Mapping

from vsup.errors import UsageError

INDEX, SIZE, LEADER = "LWS_WORKER_INDEX", "LWS_GROUP_SIZE", "LWS_LEADER_ADDRESS"
DP_PORT = 29550  # the leader's --dp-address port when the flags give none (its next ports too: addresses.py)


def in_group(env: Mapping[str, str]) -> bool:
    return INDEX in env


def group_size(values: dict) -> int:
    """How many pods a group of these flags has: --nnodes, or -dp over --dp-size-local (rounded up)."""
    if values.get("nnodes", 1) > 1:
        return values["nnodes"]
    dp, local = values.get("data_parallel_size", 1), values.get("data_parallel_size_local")
    return -(-dp // local) if local else 1


def leader_of(values: dict) -> dict:
    """The flags as the group's leader sees them (`plan --k8s` plans for it): its address stands for the
    one LWS will give."""
    size = group_size(values)
    return from_lws(values, {INDEX: "0", SIZE: str(size), LEADER: "$(LWS_LEADER_ADDRESS)"}) if size > 1 else values


def from_lws(values: dict, env: Mapping[str, str]) -> dict:
    """The ParallelConfig field values of this pod: `values` (as the flags gave them) with the group's."""
    if not in_group(env):
        return values
    index, size, leader = _read(env)
    out = dict(values)
    nnodes = values.get("nnodes", 1)
    dp, local = values.get("data_parallel_size", 1), values.get("data_parallel_size_local")
    if nnodes > 1:
        if nnodes != size:
            raise UsageError(f"--nnodes {nnodes}, but this LeaderWorkerSet's group has {SIZE}={size} pods: "
                             f"make leaderWorkerTemplate.size and --nnodes equal")
        if values.get("node_rank", 0) not in (0, index):
            raise UsageError(f"--node-rank {values['node_rank']}, but this pod is {INDEX}={index}: "
                             f"drop --node-rank, vsup reads it from the group")
        out.update(node_rank=index, headless=index > 0)
        if values.get("master_addr", "127.0.0.1") == "127.0.0.1":
            out["master_addr"] = leader
    elif local is not None and local < dp:
        if dp % local or group_size(values) != size:
            raise UsageError(f"-dp {dp} with --dp-size-local {local} makes {group_size(values)} nodes, but this "
                             f"LeaderWorkerSet's group has {SIZE}={size} pods: make them equal")
        start = values.get("data_parallel_start_rank")
        if start not in (None, index * local):
            raise UsageError(f"--dp-start-rank {start}, but this pod ({INDEX}={index}) runs ranks from "
                             f"{index * local}: drop --dp-start-rank, vsup reads it from the group")
        out.update(data_parallel_start_rank=index * local if index else None, headless=index > 0)
        if not values.get("dp_address"):
            out["dp_address"] = f"{leader}:{DP_PORT}"
    elif size > 1:
        raise UsageError(f"this LeaderWorkerSet's group has {SIZE}={size} pods, but the flags plan one node: "
                         f"give --nnodes {size} (one TP x PP group across them) or -dp with --dp-size-local")
    if values.get("headless") and index == 0:
        raise UsageError(f"--headless on the group's leader ({INDEX}=0): only the other pods are headless")
    return out


def _read(env: Mapping[str, str]) -> tuple[int, int, str]:
    try:
        index, size = int(env[INDEX]), int(env.get(SIZE, ""))
    except ValueError:
        raise UsageError(f"{INDEX}={env.get(INDEX)!r} and {SIZE}={env.get(SIZE)!r} must be whole numbers "
                         f"(LeaderWorkerSet sets both)") from None
    leader = env.get(LEADER, "")
    if not 0 <= index < size or not leader:
        raise UsageError(f"{INDEX}={index}, {SIZE}={size}, {LEADER}={leader!r}: the index must be below the "
                         f"size and the leader's address set (LeaderWorkerSet sets all three)")
    return index, size, leader
