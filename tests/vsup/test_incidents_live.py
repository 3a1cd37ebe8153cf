"""Incidents over real stand-in processes (tests/vsup/fake): each cause of a death made for real (a segfault
through ctypes, SIGKILL from outside, an exception, the kernel's OOM killer in a memory-limited cgroup made
here) gives exactly one incident, with its cause and verdict, kept before the restart and readable with
`vsup incidents` after the deployment stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.polling import wait_for
from tests.vsup.test_supervisor import TREE, ps, serving, stop, vsup
from vsup import procfs

WORKER = "worker dp0 pp0 tp0"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("VSUP_HOME", str(tmp_path))
    return tmp_path


def start(name, prefix=(), tp=1, dp=1, env=None):
    return subprocess.Popen([*prefix, sys.executable, str(TREE), name, str(tp), str(dp), "5"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def live_pids(name) -> list[int]:
    return [p["pid"] for p in ps(name)["processes"] if p["pid"]]


def stop_leaving_nothing(proc, pids: list[int]) -> None:
    """SIGTERM the supervisor: it exits 0, and none of `pids` (every process the tree had) is left."""
    code, _, err = stop(proc)
    assert code == 0, err
    assert not [pid for pid in pids if psutil.pid_exists(pid)], "a process outlived the stop"


def healed(name, old_pid):
    """ps once the worker runs again under a new pid and every process is ready."""
    def check():
        state = ps(name)
        ready = all(p["state"] == "ready" for p in state["processes"])
        return state if ready and old_pid not in {p["pid"] for p in state["processes"]} else None
    return wait_for(check, timeout=60, what="the worker's group restarted and ready")


def incidents(name):
    result = vsup("incidents", "--name", name, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def die_and_heal(name, how, prefix=(), tp=1, victim=WORKER):
    """Start the tree, end its worker `victim` by `how(pid)`, and wait for the restart; the incidents, read
    after the stop, and every pid the tree had."""
    proc = start(name, prefix, tp)
    pids, later = {}, []
    try:
        pids = {p["name"]: p["pid"] for p in serving(name)["processes"]}
        how(pids[victim])
        healed(name, pids[victim])
        later = live_pids(name)
    finally:
        stop_leaving_nothing(proc, [*pids.values(), *later])
    return incidents(name), pids


def test_a_segfault_is_one_incident_a_crash_with_its_native_stack(home):
    found, pids = die_and_heal("inc-segv", lambda pid: os.kill(pid, signal.SIGUSR1))
    assert len(found) == 1, found
    incident = found[0]
    assert (incident["unit"], incident["role"], incident["cause"]) == ("worker-group dp0", "worker", "crash")
    assert incident["verdict"] == "crashed: segmentation fault (SIGSEGV)"
    death = incident["death"]
    assert (death["process"], death["pid"], death["signal"], death["sent_by_vsup"]) == \
        (WORKER, pids[WORKER], "SIGSEGV", None)
    assert any("Fatal Python error: Segmentation fault" in line for line in incident["last_lines"][WORKER])
    assert incident["restart_s"] is not None and incident["restart_s"] < 30
    shown = vsup("incidents", "show", incident["id"], "--name", "inc-segv")
    assert shown.returncode == 0 and "crashed: segmentation fault (SIGSEGV)" in shown.stdout, shown.stderr
    listed = vsup("incidents", "--name", "inc-segv").stdout.splitlines()
    assert listed[0].split() == ["ID", "WHEN", "(UTC)", "UNIT", "PROCESS", "CAUSE", "RESTART", "LOST", "VERDICT"]
    assert "worker-group dp0" in listed[1] and "crash" in listed[1]
    # docs/operating.md shows this list as it is (its time and restart masked)
    doc = (Path(__file__).parents[2] / "docs" / "operating.md").read_text()
    sample = next(b for b in doc.split("```text\n")[1:] if b.startswith("ID  WHEN")).split("```")[0].splitlines()

    def masked(line):
        return re.sub(r"^\d+ |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d|\d+\.\ds", "*", line)
    assert sample[0] == listed[0] and masked(sample[2]) == masked(listed[1]), (sample, listed)
    # ps, also once the supervisor is gone, names each unit's last incident; its counts feed /metrics
    said = vsup("ps", "--name", "inc-segv").stdout
    assert f"last incident of worker-group dp0: 1 at {incident['at'][11:19]} UTC, crash: crashed: segmentation " \
           f"fault (SIGSEGV) (vsup incidents show 1)" in said, said
    counts = ps("inc-segv")["incidents"]["counts"]
    assert counts["worker/crash"] == 1 and sum(counts.values()) == 1 and counts["api-server/oom"] == 0


def test_sigkill_from_outside_is_told_from_the_oom_killer_and_from_vsup_with_the_survivors_stacks(home):
    """TP 2, tp1 killed: tp0 survives it until vsup ends the group, and its stacks say where it stood."""
    seen = []

    def kill(pid):
        seen.append(procfs.peak_rss(pid))
        os.kill(pid, signal.SIGKILL)
    found, pids = die_and_heal("inc-kill", kill, tp=2, victim="worker dp0 pp0 tp1")
    assert [(i["cause"], i["verdict"]) for i in found] == [
        ("killed", "killed by SIGKILL from outside vsup (not the OOM killer: its counters did not move)")]
    memory = found[0]["death"]["memory"]
    assert memory["cgroup_oom_kills"][0] == memory["cgroup_oom_kills"][1] is not None
    assert memory["peak_rss_bytes"] >= seen[0] > 0  # (its VmHWM just before the kill)
    incident = found[0]
    assert incident["survivors"] == [{"process": WORKER, "pid": pids[WORKER]}]
    assert list(incident["stacks"]) == [WORKER] and "<module> (child.py:" in incident["stacks"][WORKER], \
        incident["stacks"]
    assert 0 < incident["stacks_s"] < 3.0  # (py-spy's cost, under its deadline)


def test_an_exception_is_an_error_naming_it(home):
    found, _ = die_and_heal("inc-raise", lambda pid: os.kill(pid, signal.SIGUSR2))
    assert [(i["cause"], i["verdict"]) for i in found] == [
        ("error", "exit 1: RuntimeError: worker dp0 pp0 tp0: CUDA error: an illegal memory access was "
                  "encountered (simulated)")]


@pytest.fixture
def cgroup():
    """A memory cgroup (v1) of 300 MiB under this process's own, without swap; removed afterwards."""
    parent = procfs.memory_cgroup(os.getpid())
    if parent is None or not parent.startswith("/sys/fs/cgroup/memory"):
        pytest.skip("no cgroup v1 memory controller here to make a limited cgroup in")
    path = Path(parent) / f"vsup-oom-{os.getpid()}"
    try:
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(300 * 2**20))
        (path / "memory.swappiness").write_text("0")
    except OSError as e:
        pytest.skip(f"the kernel refused a memory cgroup with a limit ({e})")
    yield path
    wait_for(lambda: not (path / "cgroup.procs").read_text().split(), timeout=10, what="the cgroup empty")
    path.rmdir()


def test_the_oom_killer_is_named_from_the_cgroups_counter(home, cgroup):
    prefix = ("sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh")
    adjusted = []

    def hog(pid):  # (the supervisor made itself the OOM killer's last choice: lowered its own, or raised theirs)
        supervisor = ps("inc-oom")["supervisor"]["pid"]
        adjusted.append([Path(f"/proc/{p}/oom_score_adj").read_text().strip() for p in (supervisor, pid)])
        os.kill(pid, signal.SIGTTIN)
    found, pids = die_and_heal("inc-oom", hog, prefix)
    assert adjusted in ([["-500", "0"]], [["0", "100"]]), adjusted
    assert len(found) == 1, found
    incident = found[0]
    assert incident["cause"] == "oom", incident
    assert incident["verdict"] == f"killed by the kernel's OOM killer (oom_kill of the cgroup {cgroup}: 0 before, " \
                                  f"1 after)"
    assert incident["death"]["pid"] == pids[WORKER] and incident["death"]["memory"]["peak_rss_bytes"] > 100 * 2**20


def test_on_cuda_the_flight_recorder_is_on_and_its_dumps_are_listed(home, tmp_path):
    """A CUDA plan (fake/nvml stands in for the driver): every worker gets NCCL's flight recorder variables,
    and a dump the dying worker wrote (as torch's watchdog would) is listed in its incident, not loaded."""
    holders = tmp_path / "holders.json"
    holders.write_text("[]")
    proc = start("inc-nccl", env={"FAKE_NVML_HOLDERS": str(holders)})
    pids = []
    try:
        state = serving("inc-nccl")
        pids = live_pids("inc-nccl")
        worker = {p["name"]: p["pid"] for p in state["processes"]}[WORKER]
        os.kill(worker, signal.SIGUSR2)
        healed("inc-nccl", worker)
        wait_for(lambda: incidents("inc-nccl")[0]["nccl_dumps"], timeout=5, what="the dump listed")
        pids += live_pids("inc-nccl")
    finally:
        stop_leaving_nothing(proc, pids)
    prefix = str(home / "inc-nccl" / "nccl" / "trace_rank_")
    given = json.loads(Path(prefix + "0").read_text())  # (the stand-in wrote the variables it was given)
    assert given == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                     "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": prefix,
                     "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}
    (incident,) = incidents("inc-nccl")
    size = Path(prefix + "0").stat().st_size
    assert incident["nccl_dumps"] == [{"name": "trace_rank_0", "bytes": size, "path": prefix + "0"}]
    shown = vsup("incidents", "show", "1", "--name", "inc-nccl").stdout
    assert f"NCCL flight recorder dump: {prefix}0 ({size} bytes" in shown, shown


def test_deaths_together_are_one_incident_whose_first_is_the_cause(home):
    """-dp 2: both ranks' workers killed at once (as when a node's memory runs out): the first death the
    supervisor observed is the incident's cause, the other a line inside it, not an incident of its own."""
    proc = start("inc-two", dp=2)
    pids, later = {}, []
    try:
        pids = {p["name"]: p["pid"] for p in serving("inc-two")["processes"]}
        os.kill(pids["worker dp0 pp0 tp0"], signal.SIGKILL)
        os.kill(pids["worker dp1 pp0 tp0"], signal.SIGKILL)
        healed("inc-two", pids["worker dp1 pp0 tp0"])
        wait_for(lambda: all(p["state"] == "ready" and p["pid"] not in pids.values()
                             for p in ps("inc-two")["processes"] if p["role"] == "worker"), timeout=30,
                 what="both groups back")
        later = live_pids("inc-two")
    finally:
        stop_leaving_nothing(proc, [*pids.values(), *later])
    (incident,) = incidents("inc-two")
    first = incident["unit"]
    other = "worker-group dp1" if first == "worker-group dp0" else "worker-group dp0"
    assert incident["consequences"][0] == f"{other} went down too (worker {other[-3:]} pp0 tp0 signal 9 (SIGKILL))", \
        incident
    assert incident["restart_s"] is not None
