"""Every bench runs (`--smoke`: the smallest run through each code path) and report.py turns their
results into REPORT.md and its plots. Speed is never asserted here: only that each bench exits 0,
writes its JSON with the keys the report reads, and leaves no process behind.

The benches write into a temporary directory (VSUP_BENCH_RESULTS), never into bench/results.
They run two at a time (most of their time is process start-up, model loading and waiting).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
TAG_ENV = "VSUP_BENCH_SMOKE_TAG"

# bench -> the top-level keys of its JSON that report.py reads (longest first: they run two at a time)
BENCHES = {
    "api_server": ["serving", "claim", "latency", "vllm"],
    "engine_core": ["throughput", "step_overhead", "ring_round_trip", "multiprocess"],
    "scaling": ["rows", "configs", "notes"],
    "structured": ["sides", "compile", "ratio_50_over_0"],
    "supervisor": ["serve", "log", "ps"],
    "soak": ["kills", "requests", "resources"],
    "engine_decode": ["decode"],
    "plan_latency": ["vsup_plan_s", "import_typer_s", "ratio"],
    "ring_buffer": ["rows"],
    "vllm_cpu": ["detect"],
    "vllm_supervised": ["detect"],
    "peers": ["sides", "skipped", "summary", "rounds"],
    "front_relay": ["cases", "front_tokens_per_s", "itl_p99_added_ms"],
}
SECTIONS = ["## Conditions", "## Serving", "## Against peers at their defaults", "## The front's relay",
            "## Engine overhead", "## The seed's claim", "## The supervisor",
            "## Scaling", "## Structured outputs", "## Against the goals", "## Missing inputs"]
PNGS = ["serving_throughput.png", "serving_latency.png", "engine_throughput.png", "decode_step.png", "overhead.png",
        "claim.png", "supervisor.png", "scaling.png"]
PARALLEL = 2  # beside the other xdist worker: more would only share the same two cores
TIMEOUT_S = 600  # a bench past it gets SIGTERM (its Children stop what it started), then SIGKILL after GRACE_S
GRACE_S = 60  # more than the 30 s a bench gives its own children
SMOKE_TIMEOUT_S = 2400  # pytest-timeout's, for the test that runs the fixture: each bench has TIMEOUT_S already


def tagged(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries this run's tag (everything a bench started, however
    deep, unless it cleared its environment)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(TAG_ENV) == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            pass
    return found


def wait_gone(tag: str, timeout_s: float = 15.0) -> list[str]:
    """Wait for the tagged processes to exit; kill and describe those that do not."""
    deadline = time.monotonic() + timeout_s
    while (left := tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = []
    for p in left:
        try:
            described.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
            p.kill()
        except psutil.Error:
            pass
    return described


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Run every bench with --smoke into one temporary results dir; {name: (exit code, output, seconds)}."""
    results = tmp_path_factory.mktemp("bench-results")
    logs = tmp_path_factory.mktemp("bench-logs")
    tag = uuid.uuid4().hex
    env = {**os.environ, "VSUP_BENCH_RESULTS": str(results), TAG_ENV: tag, "PYTHONUNBUFFERED": "1"}
    pending, running, done = list(BENCHES), {}, {}
    before = stamps()
    try:
        while pending or running:
            while pending and len(running) < PARALLEL:
                name = pending.pop(0)
                log = open(logs / f"{name}.log", "wb")
                proc = subprocess.Popen([sys.executable, str(BENCH / f"{name}.py"), "--smoke"], cwd=REPO, env=env,
                                        stdout=log, stderr=subprocess.STDOUT)
                running[name] = (proc, log, time.monotonic())
            time.sleep(0.2)
            for name, (proc, log, started) in list(running.items()):
                if proc.poll() is None and time.monotonic() - started > TIMEOUT_S:
                    end(proc)
                if proc.poll() is not None:
                    log.close()
                    done[name] = (proc.returncode, (logs / f"{name}.log").read_text(errors="replace"),
                                  time.monotonic() - started)
                    del running[name]
    finally:
        for proc, log, _ in running.values():
            end(proc)
            log.close()
    leftovers = wait_gone(tag)
    report = subprocess.run([sys.executable, str(BENCH / "report.py"), "--results-dir", str(results)], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    return {"results": results, "runs": done, "leftovers": leftovers, "report": report,
            "bench_results_touched": sorted(set(stamps().items()) - set(before.items()))}


def end(proc: subprocess.Popen) -> None:
    """SIGTERM, so that the bench stops the servers it started; SIGKILL if it has not exited after GRACE_S."""
    proc.terminate()
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stamps() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (BENCH / "results").glob("*")} if (BENCH / "results").is_dir() else {}


@pytest.mark.timeout(SMOKE_TIMEOUT_S)
@pytest.mark.parametrize("name", list(BENCHES))
def test_bench_smoke_runs_and_writes_its_results(smoke, name):
    code, output, seconds = smoke["runs"][name]
    assert code == 0, f"bench/{name}.py --smoke exited {code} after {seconds:.0f} s:\n{output[-3000:]}"
    path = smoke["results"] / f"{name}.json"
    assert path.exists(), f"bench/{name}.py --smoke wrote no {path.name}:\n{output[-2000:]}"
    data = json.loads(path.read_text())
    missing = [key for key in BENCHES[name] if key not in data]
    assert not missing, f"{path.name} lacks {missing}"
    conditions = data["conditions"]
    assert conditions["mode"] == "smoke"
    for key in ("date", "git_commit", "cpu_count", "load_average_at_start", "load_average_at_end"):
        assert key in conditions, f"{path.name}: conditions lack {key}"


@pytest.mark.timeout(SMOKE_TIMEOUT_S)
def test_benches_leave_no_process_behind_and_bench_results_alone(smoke):
    assert not smoke["leftovers"], f"processes the benches left running: {smoke['leftovers']}"
    assert not smoke["bench_results_touched"], f"smoke runs wrote into bench/results: {smoke['bench_results_touched']}"


@pytest.mark.timeout(SMOKE_TIMEOUT_S)
def test_report_has_every_section_and_plot(smoke):
    report = smoke["report"]
    assert report.returncode == 0, report.stdout + report.stderr
    text = (smoke["results"] / "REPORT.md").read_text()
    for section in SECTIONS:
        assert section in text, f"REPORT.md has no {section!r}"
    assert "could not be built" not in text, text
    assert "None: every bench's results were there." in text
    for png in PNGS:
        path = smoke["results"] / png
        assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"no plot {png}"
        assert f"]({png})" in text, f"REPORT.md does not show {png}"


def test_report_names_the_bench_for_each_missing_input(tmp_path):
    (tmp_path / "plan_latency.json").write_text(json.dumps(
        {"conditions": {"mode": "smoke", "date": "d", "git_commit": "c", "cpu_count": 2,
                        "load_average_at_start": [1, 1, 1], "load_average_at_end": [1, 1, 1]},
         "runs": 1, "vsup_plan_s": 0.1, "import_typer_s": 0.08, "ratio": 1.25}))
    done = subprocess.run([sys.executable, str(BENCH / "report.py"), "--results-dir", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    text = (tmp_path / "REPORT.md").read_text()
    for name in BENCHES:
        if name != "plan_latency":
            assert f"bench/{name}.py --quick" in text, f"REPORT.md does not say to run {name}"
    assert "could not be built" not in text


def test_scaling_without_cuda_exits_2_with_a_message():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    done = subprocess.run([sys.executable, str(BENCH / "scaling.py"), "--device", "cuda", "--smoke"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "VSUP_BENCH_RESULTS": "/nonexistent"})
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr
