"""tools/gpu_check.sh's dry run, for real, so that the check a lent GPU host will run cannot rot here.

The dry run downloads the wheels a GPU host lacks, for this Python (cached in .gpu-wheels-cpXY),
installs them into a fresh target and imports everything from there, under a Python that has only
the host's packages of this venv. These tests run it as docs/gpu.md says, then break it on purpose:
a wheel missing from the folder, a package missing from the set.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.utils import canonicalize_name

from tools import gpu_host

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / f".gpu-wheels-cp{sys.version_info.major}{sys.version_info.minor}"  # the dry run's default
STEPS = ("host", "download", "wheels", "python", "imports", "model", "tests")


def run_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), str(out), "--dry-run", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-check")
    started = time.monotonic()
    result = run_check(tmp / "out", "--work", str(tmp / "work"))
    return SimpleNamespace(result=result, out=tmp / "out", site=tmp / "work" / "site",
                           seconds=time.monotonic() - started)


def broken_copy(tmp_path: Path, package: str, *, also_from_manifest: bool) -> Path:
    """A copy of the dry run's wheels without `package`'s wheel (and, if asked, without its manifest entry)."""
    wheels = tmp_path / "wheels"
    shutil.copytree(WHEELS, wheels)
    manifest = json.loads((wheels / gpu_host.MANIFEST).read_text())
    i = next(i for i, r in enumerate(manifest["requirements"]) if r.startswith(f"{package}=="))
    (wheels / manifest["wheels"][i]).unlink()
    if also_from_manifest:
        del manifest["requirements"][i], manifest["wheels"][i]
        (wheels / gpu_host.MANIFEST).write_text(json.dumps(manifest))
    return wheels


def test_the_dry_run_passes_and_writes_its_report(dry_run):
    assert dry_run.result.returncode == 0, dry_run.result.stdout[-3000:] + dry_run.result.stderr[-3000:]
    summary = (dry_run.out / "summary.txt").read_text()
    for step in STEPS:
        assert re.search(rf"^{step}\s+ok\s+\d+ s$", summary, re.M), summary
        assert (dry_run.out / f"{step}.log").is_file()
    assert summary.splitlines()[-1].startswith("PASSED")
    print(f"dry run: {dry_run.seconds:.1f} s")


def test_the_wheels_are_what_the_gpu_host_lacks_and_nothing_else(dry_run):
    manifest = json.loads((WHEELS / gpu_host.MANIFEST).read_text())
    names = {r.split("==")[0] for r in manifest["requirements"]}
    # what engine and vsup import that the host does not have, and what those need
    assert {"pyzmq", "msgspec", "fastapi", "starlette", "pydantic", "pydantic-core", "uvicorn", "structlog", "gguf",
            "setproctitle"} <= names
    host = gpu_host.closure(gpu_host.HOST_PACKAGES, gpu_host.installed_requires(gpu_host.target_environment("3.12")))
    assert {"numpy", "jinja2", "pyyaml", "tqdm", "click", "h11", "typing-extensions"} <= host
    # no CUDA library travels (the host's torch brings them); NVML's binding is vsup's own, pure Python
    assert not names & host and not [n for n in names if n.startswith("nvidia") and n != "nvidia-ml-py"]
    # pinned to this venv's versions, and all of them in the fresh target
    assert all(r == f"{n}=={importlib.metadata.version(n)}" for r, n in zip(manifest["requirements"], sorted(names)))
    installed = importlib.metadata.distributions(path=[str(dry_run.site)])
    assert {canonicalize_name(d.metadata["Name"]) for d in installed} == names


def test_every_import_resolved_and_the_wheels_from_the_fresh_target(dry_run):
    log = (dry_run.out / "imports.log").read_text()
    for module in ("zmq", "msgspec", "fastapi", "pydantic_core", "structlog", "gguf", "setproctitle", "uvicorn"):
        found = re.search(rf"^{module}\s+\S+\s+(\S+)$", log, re.M)
        assert found and Path(found[1]).is_relative_to(dry_run.site), (module, log[-2000:])
    counts = re.search(r"^(\d+) of (\d+) modules of vsup.* (\d+) of (\d+) modules of the wheels", log, re.M)
    assert counts and counts[1] == counts[2] and counts[3] == counts[4] and int(counts[2]) > 100, log[-2000:]


def test_the_cuda_tests_are_collected_under_the_hosts_python(dry_run):
    log = (dry_run.out / "tests.log").read_text()
    for test in ("tests/gpu/test_cuda_kernel.py::test_kernel_matches_the_torch_path_on_the_gpu[smollm2-64seqs-float16]",
                 "tests/gpu/test_cuda_serve.py::test_greedy_tokens_equal_transformers_on_the_gpu",
                 "tests/gpu/test_cuda_serve.py::test_the_worker_holds_what_the_plan_gave_it",
                 "tests/gpu/test_cuda_serve.py::test_plan_device_auto_sees_the_gpu"):
        assert test in log


def test_a_missing_wheel_stops_the_check_naming_it(dry_run, tmp_path):
    wheels = broken_copy(tmp_path, "structlog", also_from_manifest=False)
    result = run_check(tmp_path / "out", "--offline", "--wheels", str(wheels))
    assert result.returncode == 1
    assert re.search(r"FAILED at wheels: .*missing wheel in .*: structlog==", result.stderr), result.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert re.search(r"^wheels\s+FAILED", summary, re.M) and "imports" not in summary  # it stopped there


def test_a_package_missing_from_the_wheels_fails_the_imports_naming_it(dry_run, tmp_path):
    # the venv has pyzmq, but the host's Python must not see it: engine's imports of zmq fail
    wheels = broken_copy(tmp_path, "pyzmq", also_from_manifest=True)
    result = run_check(tmp_path / "out", "--offline", "--wheels", str(wheels))
    assert result.returncode == 1
    assert re.search(r"FAILED at imports: .*No module named 'zmq'", result.stderr), result.stderr
    log = (tmp_path / "out" / "imports.log").read_text()
    assert re.search(r"^FAILED engine\.\S+: ModuleNotFoundError: No module named 'zmq'", log, re.M)
    assert "model" not in (tmp_path / "out" / "summary.txt").read_text()


def test_the_wheels_install_without_pip_too(dry_run, tmp_path):
    # a host without pip: each wheel unpacked, a compiled one (msgspec) and a pure one (structlog)
    manifest = json.loads((WHEELS / gpu_host.MANIFEST).read_text())
    for wheel in manifest["wheels"]:
        if wheel.startswith(("msgspec-", "structlog-")):
            gpu_host.unpack_wheel(WHEELS / wheel, tmp_path / "site")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import msgspec, structlog; "
            "print(msgspec.__file__, structlog.__file__)")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert all(Path(p).is_relative_to(tmp_path / "site") for p in result.stdout.split())


def test_the_set_is_what_vsup_needs_beyond_what_the_host_has():
    graph = {"api": ["shared", "Only_API"], "shared": ["deep"], "host": ["shared"]}  # names canonicalized
    assert gpu_host.missing_packages(["api", "host"], ["host"], lambda n: graph.get(n, [])) == {"api", "only-api"}
    for python, applies in (("3.11", True), ("3.12", False)):
        assert gpu_host.wanted("tomli; python_version < '3.12'", gpu_host.target_environment(python)) is applies
    assert not gpu_host.wanted("pytest; extra == 'test'", gpu_host.target_environment("3.12"))
