"""The CLI's guard: an unexpected exception is one line naming it and the file that holds its traceback, exit 1;
VSUP_DEBUG=1 shows the traceback too. In-process through main.execute (what run() calls), and once for real."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.vsup.stopped_deployment import stopped_deployment
from vsup.cli.main import execute

LINE = re.compile(r"(vsup \w+): internal error: (.*) \(traceback in (\S+); VSUP_DEBUG=1 shows it\)\n")


def vsup(*argv, env=None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `vsup ARGV`, run in this process."""
    with CliRunner().isolation(env={"VSUP_DEBUG": None, **(env or {})}) as (out, err, _):
        code = execute(list(argv))
        sys.stdout.flush()
        sys.stderr.flush()
        return code, out.getvalue().decode(), err.getvalue().decode()


def crashed(stderr: str) -> tuple[str, str, Path]:
    """(command, what failed, the traceback's file) of the guard's line, which must be all of stderr."""
    match = LINE.fullmatch(stderr)
    assert match, stderr
    return match.group(1), match.group(2), Path(match.group(3))


@pytest.fixture
def boom(monkeypatch):
    """Make the plan of every command raise an error vsup does not expect."""
    def plan(*args, **kwargs):
        raise KeyError("x")

    monkeypatch.setattr("vsup.topology.plan", plan)


def test_an_unexpected_error_is_one_line_and_exit_1(boom):
    code, out, err = vsup("plan", "--device", "cpu")
    command, what, log = crashed(err)
    assert (code, out, command, what) == (1, "", "vsup plan", "KeyError: 'x'")
    assert log.parent == Path(tempfile.gettempdir()) and log.name.startswith("vsup-")
    text = log.read_text()
    log.unlink()
    assert text.startswith("Traceback (most recent call last)") and "in plan\n" in text and "KeyError: 'x'" in text


def test_vsup_debug_shows_the_traceback(boom):
    code, _, err = vsup("plan", "--device", "cpu", env={"VSUP_DEBUG": "1"})
    *traceback, line = err.splitlines(keepends=True)
    assert code == 1 and traceback[0].startswith("Traceback (most recent call last)")
    assert traceback[-1] == "KeyError: 'x'\n"
    crashed(line)[2].unlink()


def test_once_a_command_knows_its_run_dir_the_traceback_goes_to_its_logs(tmp_path, monkeypatch):
    stopped_deployment(tmp_path, "crashy")

    def render(state, flat=False):
        raise ValueError("no good")

    monkeypatch.setattr("vsup.cli.ps.render", render)
    code, _, err = vsup("ps", "--name", "crashy", env={"VSUP_HOME": str(tmp_path)})
    _, what, log = crashed(err)
    assert (code, what) == (1, "ValueError: no good")
    assert log.parent == tmp_path / "crashy" / "logs" and log.name.startswith("crash-")
    assert "ValueError: no good" in log.read_text()


def test_a_message_that_quotes_a_newline_stays_one_line(tmp_path):
    code, _, err = vsup("plan", "--device", "cpu", "--config", str(tmp_path / "two\nlines.toml"))
    assert code == 2 and err.count("\n") == 1 and "two\\nlines.toml" in err, err


def test_for_real_in_a_subprocess(tmp_path):
    """The console entry, as a person runs it: no traceback on the terminal, only the line."""
    code = ("import sys, vsup.topology\n"
            "def plan(*args, **kwargs): raise RuntimeError('wires crossed')\n"
            "vsup.topology.plan = plan\n"
            "sys.argv = ['vsup', 'plan', '--device', 'cpu']\n"
            "from vsup.cli.main import run\nrun()\n")
    env = {k: v for k, v in os.environ.items() if k != "VSUP_DEBUG"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    _, what, log = crashed(result.stderr)
    assert what == "RuntimeError: wires crossed" and "wires crossed" in log.read_text()
    log.unlink()
