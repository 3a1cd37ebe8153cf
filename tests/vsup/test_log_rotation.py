"""vsup.jsonl rotates (README: at 16 MiB, five kept): the real writer on real files, with a small size."""

import json

from vsup.supervisor.log_router import KEEP_FILES, ROTATE_BYTES, JsonlWriter


def test_the_log_rotates_past_its_size_and_keeps_five_older_files(tmp_path):
    assert (ROTATE_BYTES, KEEP_FILES) == (16 << 20, 5)  # what the README says
    path = tmp_path / "vsup.jsonl"
    writer = JsonlWriter(path, rotate_bytes=1000, keep=5)
    for i in range(400):  # ~40 bytes each: 16 rotations
        writer.write({"event": "line", "n": i})
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vsup.jsonl", *[f"vsup.jsonl.{i}" for i in range(1, 6)]]
    numbers = [json.loads(line)["n"] for name in ("vsup.jsonl.5", "vsup.jsonl.4", "vsup.jsonl.3", "vsup.jsonl.2",
                                                  "vsup.jsonl.1", "vsup.jsonl")
               for line in (tmp_path / name).read_text().splitlines()]
    assert numbers == list(range(numbers[0], 400))  # the newest lines, in order, none lost between files
    assert all((tmp_path / f"vsup.jsonl.{i}").stat().st_size >= 1000 for i in range(1, 6))
    assert oct(path.stat().st_mode & 0o777) == "0o600"
