"""The log router on a real child's pipes: every line tagged, in the order written, none lost, whether a
read ends inside a line or not, and whether a burst is all JSON (tagged in one go) or mixed with text."""

import json
import os
import subprocess
import sys

from vsup.supervisor.log_format import tag_json_lines, tag_line
from vsup.supervisor.log_router import JsonlWriter, LogRouter

TAG = {"name": "worker dp0 pp0 tp1", "role": "worker", "dp": 0, "pp": 0, "tp": 1, "pid": 7}

CHILD = r"""
import json, os, sys
lines = [json.dumps({"event": f"line {i}", "level": "INFO" if i % 7 else "error", "n": i, "name": "liar"})
         for i in range(20000)]
lines += ["a plain line between JSON lines", "", "   ", '{"event": "stamped", "timestamp": "2026-01-01T00:00:00Z"}',
          '{"not": "a record"}']
blob = ("\n".join(lines) + "\n").encode()
for at in range(0, len(blob), 4093):  # writes that end inside a line, so reads do too
    os.write(1, blob[at:at + 4093])
os.write(2, b"Traceback (most recent call last):\nValueError: boom\n")
os.write(1, b'{"event": "the last, with no newline"}')
"""


def test_every_line_of_a_real_child_lands_tagged_and_in_order(tmp_path):
    writer = JsonlWriter(tmp_path / "vsup.jsonl")
    router = LogRouter([writer.write], flushes=[writer.flush])
    router.start()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=out_w, stderr=err_w)
    os.close(out_w)
    os.close(err_w)
    router.add(out_r, "stdout", TAG)
    router.add(err_r, "stderr", TAG)
    assert child.wait(timeout=60) == 0
    router.stop()
    writer.close()
    records = [json.loads(line) for line in (tmp_path / "vsup.jsonl").read_text().splitlines()]

    out = [r for r in records if r["stream"] == "stdout"]
    assert [r["event"] for r in out] == [f"line {i}" for i in range(20000)] + [
        "a plain line between JSON lines", "stamped", '{"not": "a record"}', "the last, with no newline"]
    assert all(r["name"] == TAG["name"] and r["pid"] == 7 for r in records)  # the pipe's tag, not the line's
    assert [r["level"] for r in out[:8]] == ["error", *["info"] * 6, "error"]
    assert out[5]["n"] == 5 and list(out[5])[:3] == ["ts", "level", "name"]
    assert out[20001]["ts"] == "2026-01-01T00:00:00Z"
    err = [r for r in records if r["stream"] == "stderr"]
    assert [(r["event"], r["level"]) for r in err] == [("Traceback (most recent call last):", "error"),
                                                         ("ValueError: boom", "error")]
    assert list(router.last_stderr[TAG["name"]])[-2:] == ["Traceback (most recent call last):", "ValueError: boom"]


def test_json_lines_in_one_go_are_tagged_as_one_by_one():
    lines = ['{"event": "a", "level": "WARNING", "timestamp": "T", "pid": 1, "x": [1, 2]}',
             '{"event": 3, "stream": "theirs", "ts": "theirs"}', '  {"event": "padded"}\r']
    data = "".join(line + "\n" for line in lines).encode()
    assert tag_json_lines(data, "stdout", TAG, "ARRIVED") == [tag_line(line.rstrip("\r"), "stdout", TAG, "ARRIVED")
                                                              for line in lines]
    assert tag_line(lines[2].rstrip("\r"), "stdout", TAG, "A")["event"] == "padded"
    # anything but one JSON record a line: None, and the router tags those lines one by one
    for odd in (b'{"event": "a"}\nplain\n', b'{"event": "a"}\n\n', b'{"event": "a"} {"event": "b"}\n',
                b'{"no": "event"}\n', b"[1]\n", b'{"event": "a"}\n{"event": "trunc\n'):
        assert tag_json_lines(odd, "stdout", TAG, "A") is None, odd
