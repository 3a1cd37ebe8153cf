"""A deployment that ran and stopped, as its supervisor leaves it: state.json and logs/vsup.jsonl in its run
dir, no control.sock. `ps`, `logs`, `stop` and `restart` read it without any process running."""

from __future__ import annotations

import json
import time
from pathlib import Path

from vsup.rundir import RunDir
from vsup.topology import ParallelConfig, plan


def stopped_deployment(home: Path, name: str = "default") -> RunDir:
    """Write deployment `name` under `home` (which VSUP_HOME must name when it is read back): the processes of
    the default plan, exited, and one log line of each."""
    run_dir = RunDir(name)
    run_dir.path = home / name
    run_dir.create()
    now = time.time()
    processes = [{"name": p.name, "role": p.role, "a": p.a, "dp": p.dp, "pp": p.pp, "tp": p.tp, "node": p.node,
                  "device": p.device, "title": p.title, "unit": p.role, "pid": None, "state": "exited",
                  "restarts": 0, "last_exit": "exit 0", "started_at": now - 60}
                 for p in plan(ParallelConfig()).processes]
    run_dir.write_state({"supervisor": {"pid": 1, "name": name, "engine": "vsup", "model": "tiny",
                                        "url": "http://127.0.0.1:8000", "state": "stopped", "started_at": now - 60,
                                        "message": None, "formula": "3 processes"},
                         "units": {}, "processes": processes, "remote": []})
    with open(run_dir.log_file, "w") as f:
        for p in processes:
            f.write(json.dumps({"ts": "2026-01-01T00:00:00Z", "level": "info", "role": p["role"], "dp": p["dp"],
                                "pp": p["pp"], "tp": p["tp"], "pid": 1, "event": "hello", "name": p["name"]}) + "\n")
    return run_dir
