"""NCCL's flight recorder, on by default on CUDA: every worker keeps its last collectives in a ring
(TORCH_FR_BUFFER_SIZE; TORCH_NCCL_TRACE_BUFFER_SIZE before torch 2.9), and dumps it on a watchdog timeout
(TORCH_NCCL_DUMP_ON_TIMEOUT) to a file per rank in the run dir's nccl/ (TORCH_FR_DUMP_TEMP_FILE, the rank
appended). An incident lists the dumps written since its unit last started (incident_keeper.py); they are
torch's pickles, so vsup lists them and never loads one (`python -m torch.distributed.flight_recorder.fr_trace`
reads them). A variable the user set is left as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

BUFFER = "2000"
DIR = "nccl"
PREFIX = "trace_rank_"


def env(run_dir: Path, device: str, given: dict) -> dict[str, str]:
    """What a worker's environment gets (on CUDA), but what `given` (the user's) has already."""
    if device != "cuda":
        return {}
    folder = Path(run_dir) / DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    wanted = {"TORCH_FR_BUFFER_SIZE": BUFFER, "TORCH_NCCL_TRACE_BUFFER_SIZE": BUFFER,
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": str(folder / PREFIX),
              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(folder / PREFIX)}
    return {k: v for k, v in wanted.items() if k not in given}


def dumps(run_dir: Path, since: float) -> list[dict]:
    """The dumps written at or after `since` (wall clock): name, bytes, path."""
    folder = Path(run_dir) / DIR
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    return [{"name": e.name, "bytes": e.stat().st_size, "path": e.path} for e in entries
            if e.name.startswith(PREFIX) and e.is_file() and e.stat().st_mtime >= since]
