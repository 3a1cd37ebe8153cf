"""The states of a process and of the whole deployment, as ps and state.json spell them (each a str, so
state.json and `ps --json` carry the plain word). A unit's are the phases of lifecycle.py."""

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


class DeploymentState(StrEnum):
    """The supervisor's: serving once every process is ready (with vLLM: while any tree serves)."""

    STARTING = "starting"
    SERVING = "serving"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
