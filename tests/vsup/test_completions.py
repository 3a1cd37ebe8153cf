"""Shell completion: the committed scripts are current, `--install-completion` works in bash, and Tab answers."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPLETIONS = ROOT / "completions"
FILES = {"bash": "vsup.bash", "zsh": "_vsup", "fish": "vsup.fish"}
VSUP = [sys.executable, "-m", "vsup"]


def run(argv, env=None, **kwargs):
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **(env or {})}, **kwargs)


@pytest.fixture
def vsup_on_path(tmp_path):
    """A `vsup` on PATH that runs this checkout with this interpreter, as the scripts call it at Tab."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "vsup"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m vsup "$@"\n')
    shim.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}


def test_committed_scripts_are_current(tmp_path):
    result = run([sys.executable, str(COMPLETIONS / "generate.py"), "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    for name in FILES.values():
        assert (tmp_path / name).read_text() == (COMPLETIONS / name).read_text(), \
            f"completions/{name} is stale: run 'make completions' and commit the result"


@pytest.mark.parametrize("shell", FILES)
def test_scripts_are_what_show_completion_prints(shell):
    # Typer's own switch that makes --show-completion take the shell as a value instead of detecting it
    result = run([*VSUP, "--show-completion", shell], env={"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == (COMPLETIONS / FILES[shell]).read_text()


def test_zsh_script_can_be_autoloaded_from_fpath():
    assert (COMPLETIONS / "_vsup").read_text().splitlines()[0] == "#compdef vsup"


@pytest.mark.parametrize("shell", FILES)
def test_scripts_parse(shell):
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    result = run([shell, "-n", str(COMPLETIONS / FILES[shell])])
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_install_completion_in_bash_then_tab_completes(tmp_path, vsup_on_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {**vsup_on_path, "HOME": str(home)}
    # `; exit $?` keeps bash alive as vsup's parent, so that vsup detects bash as the shell it runs in
    result = run(["bash", "--norc", "--noprofile", "-c", "vsup --install-completion; exit $?"], env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bash completion installed" in result.stdout
    installed = home / ".bash_completions" / "vsup.sh"
    assert installed.read_text().strip() == (COMPLETIONS / "vsup.bash").read_text().strip()
    assert f"source '{installed}'" in (home / ".bashrc").read_text().splitlines()

    def tab(*words: str) -> list[str]:
        line = " ".join(words)
        script = (f"source ~/.bashrc; complete -p vsup >/dev/null || exit 3; "
                  f"COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; "
                  f"_vsup_completion vsup; printf '%s\\n' \"${{COMPREPLY[@]}}\"")
        done = run(["bash", "--norc", "--noprofile", "-c", script], env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert tab("vsup", "pl") == ["plan"]
    assert tab("vsup", "plan", "--tensor-p") == ["--tensor-parallel-size"]
    assert tab("vsup", "serve", "--log-format", "''") == ["auto", "text", "json"]


@pytest.mark.parametrize("words,expected", [
    ("vsup ", {"plan", "serve", "ps", "logs", "stop", "restart", "incidents"}),
    ("vsup serve --rest", {"--restart-policy", "--restart-max-delay"}),
    ("vsup plan --device ", {"auto", "cuda", "cpu"}),
    ("vsup plan --config missing.toml --pipeline", {"--pipeline-parallel-size"}),
    ("vsup logs --ro", {"--role"}),
])
def test_tab_answers(words, expected):
    parts = words.split(" ")
    env = {"_VSUP_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(len(parts) - 1)}
    result = run(VSUP, env=env)
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == expected
