"""man/vsup.1: current, renders without a warning, and names every option, file and variable vsup has."""

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "man" / "vsup.1"
VSUP = [sys.executable, "-m", "vsup"]
SECTIONS = ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "COMMANDS", "CONFIGURATION FILE", "EXAMPLES", "FILES",
            "ENVIRONMENT", "EXIT STATUS", "SEE ALSO"]
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def run(argv, env=None):
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def plain(roff: str) -> str:
    """The page's source as text: fonts and escapes removed."""
    text = re.sub(r"\\f[BIRP]", "", roff)
    return text.replace("\\-", "-").replace("\\&", "").replace("\\e", "\\")


def sections(roff: str) -> dict[str, str]:
    parts = re.split(r'^\.SH "?([^"\n]+)"?$', roff, flags=re.M)
    return {name: plain(body) for name, body in zip(parts[1::2], parts[2::2])}


def subsections(roff: str) -> dict[str, str]:
    """`vsup plan` -> the text of its subsection under COMMANDS."""
    commands = roff.split("\n.SH COMMANDS\n", 1)[1].split("\n.SH ", 1)[0]
    parts = re.split(r'^\.SS "?([^"\n]+)"?$', commands, flags=re.M)
    return {name: plain(body) for name, body in zip(parts[1::2], parts[2::2])}


def help_options(*command: str) -> set[str]:
    """Every option name in `vsup COMMAND --help`: the terms of its option list."""
    result = run([*VSUP, *command, "--help"])
    assert result.returncode == 0, result.stderr
    found = set()
    for line in result.stdout.splitlines():
        if re.match(r"\s{2}-", line):  # an option's term starts its line, indented two spaces
            term = re.split(r"\s{2,}", line.strip())[0]
            found.update(OPTION.findall(term))
    assert "--help" in found
    return found


def command_names() -> list[str]:
    result = run([*VSUP, "--help"])
    listing = result.stdout.split("Commands:", 1)[1]
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def roff() -> str:
    return PAGE.read_text()


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("man_generate", ROOT / "man" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_page_is_current(tmp_path):
    result = run([sys.executable, str(ROOT / "man" / "generate.py"), "--out", str(tmp_path / "vsup.1")])
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "vsup.1").read_text() == PAGE.read_text(), \
        "man/vsup.1 is stale: run 'make man' and commit the result"


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed (apt-get install groff)")
@pytest.mark.parametrize("width", [None, "60n"])
def test_groff_renders_without_warnings(width):
    result = run(["groff", "-man", "-Tutf8", "-ww", "-z", *([f"-rLL={width}"] if width else []), str(PAGE)])
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.skipif(shutil.which("man") is None, reason="man is not installed")
def test_man_renders_it_with_every_section():
    result = run(["man", "--warnings", "-l", str(PAGE)], env={"MANWIDTH": "80", "MANPAGER": "cat", "PAGER": "cat"})
    assert result.returncode == 0 and result.stderr == "", result.stderr
    text = re.sub(r".\x08", "", result.stdout)  # overstrike bold and underline, should man keep them
    headings = [line for line in text.splitlines() if line and not line[0].isspace()]
    assert [h for h in headings if h in SECTIONS] == SECTIONS


def test_has_every_section_in_order(roff):
    assert list(sections(roff)) == SECTIONS


def test_every_command_and_every_option_of_its_help_is_in_its_subsection(roff):
    commands = command_names()
    assert {"plan", "serve", "ps", "logs", "stop", "restart"} <= set(commands)
    documented = subsections(roff)
    assert list(documented) == [f"vsup {name}" for name in commands]
    for name in commands:
        text = documented[f"vsup {name}"]
        missing = {opt for opt in help_options(name) if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text)}
        assert not missing, f"vsup {name}: {sorted(missing)} in --help but not in man/vsup.1"
    options = sections(roff)["OPTIONS"]
    assert all(opt in options for opt in help_options())


def test_environment_names_every_variable(roff, generator):
    environment = sections(roff)["ENVIRONMENT"]
    import typer.main

    from vsup.cli.main import app

    root = typer.main.get_command(app)
    root_ctx = root.make_context("vsup", [], resilient_parsing=True)
    option_variables = set(generator.option_variables(root, root_ctx))
    assert {"VSUP_TENSOR_PARALLEL_SIZE", "VSUP_CONFIG", "VSUP_NAME", "VSUP_PORT"} <= option_variables
    required = {"VSUP_HOME", "VSUP_CACHE_DIR", "VSUP_API_KEY", "VSUP_ENABLE_MULTIPROCESSING", "VSUP_LOG_FORMAT",
                "VSUP_LOG_LEVEL", "NOTIFY_SOCKET"}
    # every VSUP_* name the code reads or sets, so that a new variable cannot go undocumented
    in_code = {name for folder in ("vsup", "engine") for path in (ROOT / folder).rglob("*.py")
               for name in re.findall(r"\bVSUP_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    missing = {name for name in option_variables | required | in_code
               if not re.search(rf"(?<![\w-]){name}(?![\w-])", environment)}
    assert not missing, f"{sorted(missing)} missing from ENVIRONMENT: describe them in man/generate.py"


def test_files_and_exit_status(roff):
    files = sections(roff)["FILES"]
    for needle in ("$VSUP_HOME/NAME", "~/.local/state/vsup", "state.json", "logs/vsup.jsonl", "vsup.jsonl.1",
                   "vsup.jsonl.5", "control.sock", "supervisor.pid", "engines.sock", "workers.sock",
                   "~/.cache/vsup/models"):
        assert needle in files, needle
    status = sections(roff)["EXIT STATUS"]
    for code in ("0", "1", "2"):
        assert re.search(rf"^\.TP\n{code}\n", status, flags=re.M), code


def test_examples_use_only_options_that_exist(generator):
    import typer.main

    from vsup.cli.main import app

    root = typer.main.get_command(app)
    ctx = root.make_context("vsup", [], resilient_parsing=True)
    checked = 0
    for _, lines in generator.EXAMPLES:
        for line in lines:
            if not re.match(r"(\w+=\S+ )*vsup ", line):  # curl and the like
                continue
            words = shlex.split(line)
            while "=" in words[0]:  # VAR=value before the command
                words.pop(0)
            command = root.get_command(ctx, words[1])
            assert command is not None, line
            known = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)} | {"--help"}
            unknown = [w for w in words[2:] if w.startswith("-") and w.split("=")[0] not in known]
            assert not unknown, f"{line!r}: {unknown} not options of vsup {words[1]}"
            checked += 1
    assert checked >= 8


def test_plan_examples_run(generator, tmp_path):
    cpu = {"VSUP_DEVICE": "cpu"}  # so that `-tp 4` plans on a machine with fewer GPUs too
    for _, lines in generator.EXAMPLES:
        for line in lines:
            if line.startswith("vsup plan") and "./" not in line:
                result = run([*VSUP, *shlex.split(line)[1:]], env=cpu)
                assert result.returncode == 0, f"{line}: {result.stderr}"
    # the configuration file example, less its model (a path on the reader's machine)
    config = tmp_path / "deploy.toml"
    config.write_text("".join(line + "\n" for line in generator.CONFIG_EXAMPLE.splitlines()
                              if not line.startswith("model")))
    result = run([*VSUP, "plan", "--config", str(config), "--json"], env=cpu)
    assert result.returncode == 0, result.stderr
    assert '"total": 5' in result.stdout
