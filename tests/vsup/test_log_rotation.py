"""vsup.jsonl rotates (docs/reference.md: at 16 MiB, five kept): the real writer on real files, with a small size."""

import json

from vsup.supervisor.log_router import KEEP_FILES, ROTATE_BYTES, JsonlWriter


def test_the_log_rotates_past_its_size_and_keeps_five_older_files(tmp_path):
    assert (ROTATE_BYTES, KEEP_FILES) == (16 << 20, 5)  # what docs/reference.md says
    path = tmp_path / "vsup.jsonl"
    writer = JsonlWriter(path, rotate_bytes=1000, keep=5)
    for i in range(400):  # ~40 bytes each: 16 rotations
        writer.write([{"event": "line", "n": i}])
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vsup.jsonl", *[f"vsup.jsonl.{i}" for i in range(1, 6)]]
    numbers = [json.loads(line)["n"] for name in ("vsup.jsonl.5", "vsup.jsonl.4", "vsup.jsonl.3", "vsup.jsonl.2",
                                                  "vsup.jsonl.1", "vsup.jsonl")
               for line in (tmp_path / name).read_text().splitlines()]
    assert numbers == list(range(numbers[0], 400))  # the newest lines, in order, none lost between files
    assert all((tmp_path / f"vsup.jsonl.{i}").stat().st_size >= 1000 for i in range(1, 6))
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_records_wait_for_a_flush_and_then_land_in_order(tmp_path):
    path = tmp_path / "vsup.jsonl"
    writer = JsonlWriter(path)
    for i in range(3):
        writer.write([{"event": "line", "n": i, "at": tmp_path}])  # a Path: written as its text
    assert path.read_text() == ""  # one write a batch, not one a line
    writer.flush()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"event": "line", "n": i, "at": str(tmp_path)} for i in range(3)]
    writer.write([{"event": "last"}])
    writer.close()  # flushes
    assert json.loads(path.read_text().splitlines()[-1]) == {"event": "last"}


def test_a_line_is_tagged_by_its_pipe_not_by_its_own_words():
    from vsup.supervisor.log_format import tag_line

    tag = {"name": "worker dp0 pp0 tp1", "role": "worker", "dp": 0, "pp": 0, "tp": 1, "pid": 7}
    record = tag_line('{"event": "hi", "level": "WARNING", "timestamp": "T", "name": "liar", "pid": 1, "x": 2}',
                      "stdout", tag, "ARRIVED")
    assert record == {"ts": "T", "level": "warning", **tag, "stream": "stdout", "event": "hi", "x": 2}
    assert list(record)[:3] == ["ts", "level", "name"]
    plain = tag_line("Traceback (most recent call last):", "stderr", tag, "ARRIVED")
    assert plain == {"ts": "ARRIVED", "level": "error", **tag, "stream": "stderr",
                     "event": "Traceback (most recent call last):"}
    assert tag_line('{"not": "a record"}', "stdout", tag, "A")["event"] == '{"not": "a record"}'
    assert tag_line("{broken", "stdout", tag)["ts"]  # now, when no arrival time is given
