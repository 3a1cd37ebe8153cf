"""The logging setup every process of the tree calls: JSON lines off a TTY, who wrote each line."""

import json
import subprocess
import sys

import pytest

CHILD = r"""
import logging, sys
from engine.log import configure
log = configure("worker", dp=0, pp=1, tp=2, fmt=sys.argv[1])
log.info("weights loaded", nbytes=123)
logging.getLogger("uvicorn.error").warning("from the stdlib")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("step failed")
log.debug("hidden at info level")
"""


def run_child(fmt):
    result = subprocess.run([sys.executable, "-c", CHILD, fmt], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_json_lines_carry_role_ranks_and_level():
    lines = [json.loads(line) for line in run_child("auto").splitlines()]  # a pipe is not a TTY: JSON
    assert [line["event"] for line in lines] == ["weights loaded", "from the stdlib", "step failed"]
    for line in lines:
        assert (line["role"], line["dp"], line["pp"], line["tp"]) == ("worker", 0, 1, 2)
        assert isinstance(line["pid"], int) and line["timestamp"].endswith("Z")
    assert lines[0]["level"] == "info" and lines[0]["nbytes"] == 123
    assert lines[1]["level"] == "warning" and lines[1]["logger"] == "uvicorn.error"
    assert lines[2]["level"] == "error" and "ZeroDivisionError" in lines[2]["exception"]


def test_text_format_is_for_humans():
    out = run_child("text")
    assert "weights loaded" in out and "role=worker" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.splitlines()[0])


def test_unknown_format_is_refused():
    from engine.log import configure
    with pytest.raises(ValueError, match="log format"):
        configure("worker", fmt="yaml")
