"""The states of a process, a restart unit, a vLLM tree and the whole deployment, as ps and state.json
spell them (each a str, so state.json and `ps --json` carry the plain word)."""

from __future__ import annotations

from enum import StrEnum


class ProcessState(StrEnum):
    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    EXITED = "exited"      # died; its unit decides what follows
    BACKOFF = "backoff"    # waiting to start again
    FAILED = "failed"      # its unit gave up
    STOPPING = "stopping"
    STOPPED = "stopped"


class UnitState(StrEnum):
    RUNNING = "running"
    BACKOFF = "backoff"
    FAILED = "failed"


class TreeState(StrEnum):
    """One vLLM tree (a replica)."""

    STARTING = "starting"
    SERVING = "serving"
    RESTARTING = "restarting"
    FAILED = "failed"


class DeploymentState(StrEnum):
    """The supervisor's: serving once every process is ready (with vLLM: while any tree serves)."""

    STARTING = "starting"
    SERVING = "serving"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
