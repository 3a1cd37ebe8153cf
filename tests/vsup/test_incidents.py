"""Incidents' pure rules (vsup/supervisor/incidents.py) and their store (incident_store.py)."""

from __future__ import annotations

import os
import signal
import stat

from vsup.exits import returncode_of
from vsup.supervisor import incident_store
from vsup.supervisor.incidents import Death, Memory, consequence_of, open_incident, raised, signal_of, verdict

TRACEBACK = ["Traceback (most recent call last):", '  File "w.py", line 3, in <module>',
             "RuntimeError: CUDA error: out of memory (simulated)"]


def death(returncode, sent=None, memory=Memory()):
    exit = f"signal {-returncode} ({signal.Signals(-returncode).name})" if returncode < 0 else f"exit {returncode}"
    return Death("worker dp0 pp0 tp0", 42, returncode, exit, sent, memory)


def test_each_kind_of_death_gets_its_cause_and_verdict():
    oom = Memory(cgroup="/sys/fs/cgroup/memory/x", cgroup_oom_kills=(0, 1), machine_oom_kills=(3, 4))
    assert verdict(death(-9, memory=oom), "x", []) == (
        "oom", "killed by the kernel's OOM killer (oom_kill of the cgroup /sys/fs/cgroup/memory/x: 0 before, 1 after)")
    # the machine's counter stands in where the cgroup has none
    assert verdict(death(-9, memory=Memory(machine_oom_kills=(3, 4))), "x", [])[0] == "oom"
    still = Memory(cgroup="c", cgroup_oom_kills=(1, 1), machine_oom_kills=(4, 5))  # another cgroup's OOM kill
    assert verdict(death(-9, memory=still), "x", []) == (
        "killed", "killed by SIGKILL from outside vsup (not the OOM killer: its counters did not move)")
    assert verdict(death(-9, sent="SIGKILL"), "x", []) == ("killed", "killed by vsup (SIGKILL)")
    assert verdict(death(-11), "x", []) == ("crash", "crashed: segmentation fault (SIGSEGV)")
    assert verdict(death(-6), "x", []) == ("crash", "crashed: aborted (SIGABRT)")
    assert verdict(death(-15), "x", []) == ("killed", "killed by SIGTERM from outside vsup")
    assert verdict(death(-15, sent="SIGTERM"), "x", []) == ("killed", "ended by vsup's SIGTERM")
    assert verdict(death(1), "x", TRACEBACK) == ("error", "exit 1: RuntimeError: CUDA error: out of memory (simulated)")
    assert verdict(death(0), "x", []) == ("exit", "exit 0 unasked")
    assert verdict(death(137), "x", []) == (  # a shell in between reports 128+N
        "killed", "killed by SIGKILL from outside vsup (not the OOM killer: its counters did not move) "
                  "(exit 137: 128+9, as a shell reports it)")
    assert verdict(None, "hung: no token for 12 s with 3 requests waiting", []) == (
        "hang", "hung: no token for 12 s with 3 requests waiting")
    assert verdict(None, "/health has failed for 31 s", [])[0] == "health"


def test_the_small_readers():
    assert [signal_of(c) for c in (-9, 137, 1, 0, None, 200)] == [9, 9, None, None, None, None]
    assert raised(["x", "KeyError: 'missing'", "then a native line"]) == "KeyError: 'missing'"
    assert raised(["torch.OutOfMemoryError: CUDA out of memory"]) == "OutOfMemoryError: CUDA out of memory"
    assert raised(["nothing here"]) is None
    assert raised(["error Traceback (most recent call last):", "error ValueError: bad"]) == "ValueError: bad"
    assert [returncode_of(e) for e in ("exit 1", "signal 9 (SIGKILL)", "exited", None)] == [1, -9, None, None]


def test_a_unit_down_soon_after_another_is_a_consequence_until_that_one_serves_again():
    first = open_incident("1", "t", 100.0, "worker-group dp0", "worker", "exit 1", death(1), {}, [])
    assert consequence_of([first], 103.0) is first
    assert consequence_of([first], 106.0) is None  # (5 s on: one of its own)
    first.restart_s = 2.0
    assert consequence_of([first], 103.0) is None  # closed: a new death is a new incident


def test_the_store_keeps_the_last_100_in_0600_files_numbered_on(tmp_path):
    assert incident_store.next_id(tmp_path) == "1"
    for n in range(1, 104):
        incident_store.write(tmp_path, {"id": str(n), "verdict": "x"})
    folder = incident_store.directory(tmp_path)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(folder / f).st_mode) for f in os.listdir(folder)} == {0o600}
    kept = [i["id"] for i in incident_store.load_all(tmp_path)]
    assert kept == [str(n) for n in range(103, 3, -1)]  # newest first, the oldest 3 gone
    assert incident_store.next_id(tmp_path) == "104" and incident_store.load(tmp_path, "50")["id"] == "50"
    assert incident_store.load(tmp_path, "2") is None and incident_store.load(tmp_path, "../x") is None


def test_the_store_drops_the_oldest_beyond_its_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(incident_store, "MAX_BYTES", 3000)
    for n in range(1, 6):
        incident_store.write(tmp_path, {"id": str(n), "lines": ["x" * 100] * 9})  # ~1 KB each
    folder = incident_store.directory(tmp_path)
    size = (folder / "5.json").stat().st_size  # (each the same)
    assert 3000 // size < 5
    assert [i["id"] for i in incident_store.load_all(tmp_path)] == [str(n) for n in range(5, 5 - 3000 // size, -1)]


def test_the_flight_recorder_is_on_only_on_cuda_and_never_over_the_users_own(tmp_path):
    from vsup.supervisor import flight_recorder

    assert flight_recorder.env(tmp_path, "cpu", {}) == {}
    on = flight_recorder.env(tmp_path, "cuda", {"TORCH_FR_BUFFER_SIZE": "50"})
    assert "TORCH_FR_BUFFER_SIZE" not in on and on["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert on["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "nccl" / "trace_rank_")
    (tmp_path / "nccl" / "trace_rank_1").write_bytes(b"x")
    (tmp_path / "nccl" / "other").write_bytes(b"x")
    assert [d["name"] for d in flight_recorder.dumps(tmp_path, 0)] == ["trace_rank_1"]
    assert flight_recorder.dumps(tmp_path, 4e9) == []  # (written before the unit started: not its)
