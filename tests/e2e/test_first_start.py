"""A first `vsup serve` on a machine: it converts the default model, and every line it prints, the
conversion's included, is in the one format of the console (`--log-format text`, as on a terminal) or a
JSON record (`--log-format json`, as in a pod's log), tagged by who wrote it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import psutil
import pytest

from tests.local_deployment import free_port
from tests.polling import wait_for

VSUP = [sys.executable, "-m", "vsup"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_conversion_prints_as_every_other_line(fmt, tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VSUP_")},
           "VSUP_HOME": str(tmp_path / "home"), "VSUP_CACHE_DIR": str(tmp_path / "cache")}
    out = open(tmp_path / "out", "w+")
    proc = subprocess.Popen([*VSUP, "serve", "--port", str(free_port()), "--device", "cpu", "--log-format", fmt],
                            env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: proc.poll() is None and "serving SmolLM2-135M-Instruct" in (tmp_path / "out").read_text(),
                 timeout=180, what="serving the default model, converted first")
        tree = psutil.Process(proc.pid).children(recursive=True)
    finally:
        stopped = subprocess.run([*VSUP, "stop"], env=env, capture_output=True, text=True, timeout=60)
        proc.wait(timeout=60)
    assert stopped.returncode == 0 and proc.returncode == 0
    assert len(tree) == 3 and not [p for p in tree if p.is_running()]  # its tree went with it
    lines = (tmp_path / "out").read_text().splitlines()
    if fmt == "json":
        records = [json.loads(line) for line in lines]  # each line one record
        said = [(r["name"], r["event"], r.get("percent")) for r in records]
    else:
        parts = [re.fullmatch(r"(\S+(?: \S+)*) +\| (.*)", line) for line in lines]
        assert all(parts), [line for line, m in zip(lines, parts) if not m]  # NAME | event, every line
        assert len({line.index("|") for line in lines}) == 1  # one column for every name, the model's too
        said = [(m[1], m[2], None) for m in parts]
    names = [name for name, _, _ in said]
    first = names.index("supervisor")
    assert first > 0 and set(names[:first]) == {"model"} and "model" not in names[first:]  # the conversion first
    events = [event for _, event, _ in said[:first]]
    assert events[0].startswith("converting the default model once")
    assert events[-1].startswith("default model ready")
    if fmt == "json":
        assert [p for _, e, p in said[:first] if e == "converting SmolLM2-135M-Instruct"] == \
            list(range(0, 101, 10))
    else:
        assert sum(e.startswith("converting SmolLM2-135M-Instruct done=") for e in events) == 11
