"""What `vsup serve` can know without a process, it checks before the first process starts: the run dir, the
model directory, the default model's cache. Each refusal is one line and exit 2, and psutil sees no child."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.local_deployment import free_port, with_test_tokenizer
from vsup.errors import UsageError
from vsup.rundir import RunDir

VSUP = [sys.executable, "-m", "vsup"]


def serve_watching_children(*args, env: dict) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`vsup serve ARGS` in a subprocess, with the command line of every child psutil saw it start (the last
    seen alive: a child caught between its fork and its exec still shows vsup's own): its children are polled
    every few milliseconds until it exits, where a started tree lives for seconds."""
    proc = subprocess.Popen([*VSUP, "serve", "--port", str(free_port()), "--device", "cpu", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watched, seen = psutil.Process(proc.pid), {}
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            for child in watched.children(recursive=True):
                seen[child.pid] = " ".join(child.cmdline()) or seen.get(child.pid, "?")  # (a zombie has none)
        except psutil.Error:  # it exited meanwhile, or a child did
            pass
        time.sleep(0.002)
    stdout, stderr = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), sorted(seen.values())


@pytest.fixture
def env(tmp_path):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VSUP_")}
    return {**clean, "VSUP_HOME": str(tmp_path / "home")}


@pytest.fixture
def model(tiny_model, tmp_path):
    return with_test_tokenizer(tiny_model("llama"), tmp_path / "model")


def test_a_run_dir_that_cannot_be_created_is_refused_before_any_process(env, model):
    """The issue's first case: VSUP_HOME=/proc/nope was a FileNotFoundError traceback, exit 1."""
    result, children = serve_watching_children(str(model), env={**env, "VSUP_HOME": "/proc/nope"})
    assert (result.returncode, children, result.stdout) == (2, [], "")
    assert result.stderr == ("vsup serve: error: the run dir /proc/nope/default cannot be created (in /proc): No such "
                             "file or directory; it comes from VSUP_HOME=/proc/nope: set VSUP_HOME to a directory you "
                             "can write\n")


def test_a_model_without_a_tokenizer_is_refused_before_any_process(env, model, tmp_path):
    """The issue's second case: the tree started and its API server died at start, again and again."""
    (model / "tokenizer.json").unlink()
    result, children = serve_watching_children(str(model), env=env)
    assert (result.returncode, children, result.stdout) == (2, [], "")
    assert result.stderr.count("\n") == 1 and "has no tokenizer.json" in result.stderr, result.stderr
    assert not (tmp_path / "home").exists()  # no run dir either


def test_an_unwritable_model_cache_is_refused_before_converting(env, tmp_path):
    """Without MODEL, serve's one helper process checks the cache before converting: one line, exit 2."""
    (tmp_path / "file").write_text("")
    result, children = serve_watching_children(env={**env, "VSUP_CACHE_DIR": str(tmp_path / "file" / "cache")})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"the model cache {tmp_path}/file/cache/models cannot be written (Not a directory); it comes from " \
           f"VSUP_CACHE_DIR={tmp_path}/file/cache: set VSUP_CACHE_DIR to a directory of yours; or give a MODEL " \
           f"directory" in result.stderr
    assert [c for c in children if "engine.model.default_model" not in c and " -m vsup serve " not in c] == []


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("VSUP_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_good_run_dir_passes_and_the_check_leaves_nothing(home):
    RunDir("x").check()
    assert not home.exists()
    home.mkdir()
    RunDir("x").check()
    run_dir = RunDir("x")
    run_dir.create()
    run_dir.check()
    assert sorted(p.name for p in home.rglob("*")) == ["logs", "x"]


def refused(name="x") -> str:
    with pytest.raises(UsageError) as e:
        RunDir(name).check()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_run_dir_under_a_file(home):
    home.parent.joinpath("file").write_text("")
    os.environ["VSUP_HOME"] = str(home.parent / "file")
    assert "cannot be used (Not a directory); it comes from VSUP_HOME=" in refused()


def test_a_run_dir_from_xdg_state_home_names_it(home, monkeypatch):
    monkeypatch.delenv("VSUP_HOME")
    monkeypatch.setenv("XDG_STATE_HOME", "/proc/nope")
    assert "it comes from XDG_STATE_HOME=/proc/nope: set VSUP_HOME" in refused()


@pytest.mark.parametrize("which", ["run dir", "logs"])
def test_a_run_dir_open_to_others(home, which):
    run_dir = RunDir("x")
    run_dir.create()
    os.chmod(run_dir.path if which == "run dir" else run_dir.log_dir, 0o750)
    message = refused()
    assert "is open to others (mode 0750), so its control.sock would be too: chmod 700" in message
    assert "choose another --name or set VSUP_HOME" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_run_dir_of_another_user(home):
    run_dir = RunDir("x")
    run_dir.create()
    os.chown(run_dir.path, 65534, 65534)
    assert "belongs to uid 65534, not to you (uid 0), and its control.sock would be theirs" in refused()


def test_a_run_dir_that_is_a_file(home):
    home.mkdir()
    (home / "x").write_text("")
    assert "is not a directory" in refused()
