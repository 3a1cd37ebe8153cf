"""No traceback, ever: argv, VSUP_* variables and --config files for every command, drawn by hypothesis from
the Typer app's own option definitions (click's params: names, types, choices, flags, variables).

Each run goes through main.execute, the function the console entry runs, in this process through Typer's test
runner (500 examples), and a few in real subprocesses. Whatever was drawn (valid and invalid values, missing
values, unknown flags, combinations such as --headless without --dp-address, bad run dirs, model directories
that lack something), the run prints no traceback and ends 0, 1 or 2, and a non-zero end is one line on stderr
that names a flag, a file or a variable, never an internal error.

How no example starts a tree: in this process, serve's only ways to start processes are replaced for the test:
`supervise` (the supervisor, which starts the tree) records that it was reached and returns 0 at once,
`default_model` (the helper process that converts the default model) returns a model directory without a
process, and `serve_flags` (which runs `vllm serve --help=all`) answers from a canned list. CUDA_VISIBLE_DEVICES
is empty, so nvidia-smi never runs; run dirs are under a temp dir. `ps --watch` and `logs -f` on the stopped
deployment there end at their first sleep. In subprocesses nothing is replaced: VSUP_HOME is always a path
under a regular file, which serve refuses (RunDir.check) before its first process, and where no deployment is.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer.main
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.conftest import BASE
from tests.model_dirs import header_only_model
from tests.vsup.stopped_deployment import stopped_deployment
from vsup.cli.main import execute, make_app

COMMANDS = dict(typer.main.get_command(make_app()).commands)  # name -> click command, as `vsup --help` lists
VARIABLES = sorted({p.envvar for c in COMMANDS.values() for p in c.params if p.envvar} | {
    "VSUP_HOME", "VSUP_CACHE_DIR", "VSUP_DEBUG", "XDG_STATE_HOME"})
# a flag (-x, --xy), a file or directory (a path, a config file), or a variable
NAMES_A_THING = re.compile(r"(?<![\w-])--?[A-Za-z]|/|\.(toml|ya?ml|json)\b|\b(VSUP|XDG)_[A-Z_]+|\bMODEL\b")

TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
PLACES = {  # what a value that names a place is drawn from: {world} is this module's temp dir
    "model": ["{world}/good", "{world}/no-tokenizer", "{world}/no-weights", "{world}/other-shape",
              "{world}/gemma", "{world}/empty", "{world}/file", "{world}/nowhere", "{world}/good/"],
    "config": ["{config}", "{config}", "{config}", "{world}/nowhere.toml", "{world}", "{world}/file"],
    "name": ["default", "default", "x", "a/b", "..", "", ".x", "-x", "a" * 65, "é"],
    "host": ["127.0.0.1", "::1", "0.0.0.0", "localhost", "no-such-host.invalid", "::g", "[::1]"],
    "dp_address": ["10.0.0.1:29550", "[::1]:29550", "127.0.0.1:1", "10.0.0.1", ":", "h:0", "h:99999", "a:b", ""],
    "master_addr": ["127.0.0.1", "10.0.0.1", "::1", ""],
    "kv_cache_memory": ["1GiB", "4MiB", "512MiB", "2G", "1000000", "12XB", "1e999", "9" * 400, "0", "-1", ""],
    "since": ["30s", "10m", "2h", "1d", "99999999999999d", "2026-11-29T10:00:00", "2026-13-01", "garbage", ""],
    "role": ["api-server", "engine-core", "worker", "coordinator", "front", "supervisor", "helper", "bogus", ""],
    "level": ["debug", "info", "warning", "error", "critical", "INFO", "bogus"],
    "vllm_bin": ["{world}/nowhere/vllm", "/bin/true", ""],
}
HOMES = ["{world}/home"] * 5 + ["/proc/nope", "{world}/file/home", "{world}/open-home", "xdg:{world}/xdg",
                                "xdg:/proc/nope"]
UNKNOWN = ["--bogus", "-z", "--tensor-parallel", "--no-json", "---", "--help=x"]


def values(param) -> st.SearchStrategy[str]:
    """What to give an option or argument on the command line or in its variable: valid and invalid."""
    if param.name in PLACES:
        return st.one_of(st.sampled_from(PLACES[param.name]), TEXT)
    choices = getattr(param.type, "choices", None)
    if choices:
        valid = [str(getattr(c, "value", c)) for c in choices]
        return st.one_of(st.sampled_from(valid), st.sampled_from([v.upper() for v in valid]), TEXT)
    if param.type.name in ("int", "integer"):
        return st.one_of(st.integers(-2, 9).map(str), st.sampled_from(
            ["0", "65535", "65536", "2147483648", "9" * 30, "-99999999999", "1.5", "abc", ""]))
    if param.type.name == "float":
        return st.one_of(st.floats(-5, 1e4, allow_nan=False).map(repr), st.sampled_from(
            ["nan", "inf", "-inf", "1e999", "0", "-1", "abc", ""]))
    if param.type.name in ("bool", "boolean"):
        return st.sampled_from(["1", "0", "true", "false", "yes", "off", "maybe", ""])
    return TEXT


def option_args(param) -> st.SearchStrategy[list[str]]:
    """An option as it is written: a flag alone (or its --no- form), else its name and a value, or a name whose
    value is missing (at the end of argv) or is the next flag."""
    if param.is_flag:
        return st.sampled_from([[o] for o in (*param.opts, *param.secondary_opts)])
    return st.tuples(st.sampled_from(param.opts), values(param)).map(list)


@st.composite
def config_files(draw, command) -> tuple[str, str]:
    """(suffix, text) of a --config file: keys of either command with --config, and unknown ones, valued
    with what a parser can give (numbers, booleans, strings, lists, nothing)."""
    keys = sorted({n[2:] for c in ("plan", "serve") for p in COMMANDS[c].params if p.param_type_name == "option"
                   for n in p.opts if n.startswith("--")} | {"model"})
    key = st.one_of(st.sampled_from(keys), st.sampled_from(keys).map(lambda k: k.replace("-", "_")),
                    st.sampled_from(["tp", "bogus", "tensor-paralel-size", "config", "help"]))
    params = {p.name: p for c in ("plan", "serve") for p in COMMANDS[c].params}
    scalar = st.one_of(st.integers(-2, 70000), st.floats(allow_nan=False), st.booleans(), TEXT)

    def valued(k):
        param = params.get(k.replace("-", "_"))
        own = values(param) if param is not None else TEXT
        if k == "model":
            own = st.sampled_from(PLACES["model"])
        return st.tuples(st.just(k), st.one_of(own, scalar, st.lists(scalar, max_size=2), st.none()))

    items = draw(st.lists(key.flatmap(valued), max_size=4))
    suffix = draw(st.sampled_from([".toml", ".toml", ".yaml", ".yml", ".json"]))
    if suffix == ".toml":
        text = "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in items)
    else:
        text = yaml.safe_dump(dict(items)) if items else ""
    return suffix, draw(st.one_of(st.just(text), st.just(text), st.sampled_from(["[", "- 1\n", "\x00", "a = "])))


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""  # `key = ` is no TOML: the file is refused
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}[repr(value)]
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


@dataclass
class Invocation:
    argv: list[str]
    env: dict[str, str] = field(default_factory=lambda: {"VSUP_HOME": "{world}/home"})
    config: tuple[str, str] | None = None


@st.composite
def invocations(draw) -> Invocation:
    """argv, environment and --config file of one run of one command (or of `vsup` itself)."""
    name = draw(st.sampled_from([*COMMANDS, *COMMANDS, "stpo", ""]))
    command = COMMANDS.get(name)
    argv = [name] if name else []
    options = [p for p in command.params if p.param_type_name == "option"] if command else []
    arguments = [p for p in command.params if p.param_type_name == "argument"] if command else []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["option"] * 8 + ["argument", "unknown"]))
        if kind == "option" and options:
            argv += draw(st.sampled_from(options).flatmap(option_args))
        elif kind == "argument" and arguments:
            argv.append(draw(values(arguments[0])))
        elif kind == "argument":
            argv.append(draw(TEXT))
        else:
            argv.append(draw(st.sampled_from(UNKNOWN)))
    if options and draw(st.integers(0, 9)) == 0:  # an option whose value is missing
        argv.append(draw(st.sampled_from([n for p in options if not p.is_flag for n in p.opts])))
    if name in ("plan", "serve") and draw(st.integers(0, 5)) == 0:  # what follows -- (for a stock vLLM)
        argv += ["--", *draw(st.lists(st.sampled_from(["--enforce-eager", "--load-format", "dummy", "x"]),
                                      max_size=2))]
    if draw(st.integers(0, 19)) == 0:
        argv.append(draw(st.sampled_from(["--help", "--version"])))
    env = {}
    for param in draw(st.lists(st.sampled_from(options), max_size=3, unique_by=lambda p: p.name)) if options else []:
        env[param.envvar] = draw(values(param))
    home = draw(st.sampled_from(HOMES))
    env["XDG_STATE_HOME" if home.startswith("xdg:") else "VSUP_HOME"] = home.removeprefix("xdg:")
    config = None
    if name in ("plan", "serve") and draw(st.integers(0, 3)) == 0:
        config = draw(config_files(name))
        if "{config}" not in " ".join(argv) and "{config}" not in env.values():
            if draw(st.booleans()):
                argv += ["--config", "{config}"]
            else:
                env["VSUP_CONFIG"] = "{config}"
    return Invocation(argv, env, config)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The places values name: model directories complete and not, homes with a stopped deployment, a file."""
    world = tmp_path_factory.mktemp("world")
    config = BASE | {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True,
                     "torch_dtype": "float32"}
    header_only_model(world / "good", config)
    for name, drop in (("no-tokenizer", "tokenizer.json"), ("no-weights", "model.safetensors")):
        (header_only_model(world / name, config) / drop).unlink()
    header_only_model(world / "other-shape", config)
    (world / "other-shape" / "config.json").write_text(json.dumps(config | {"intermediate_size": 256}))
    header_only_model(world / "gemma", config | {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"})
    (world / "empty").mkdir()
    (world / "file").write_text("")
    stopped_deployment(world / "home")
    stopped_deployment(world / "open-home")
    os.chmod(world / "open-home" / "default", 0o755)
    return world


@pytest.fixture(scope="module")
def reached(world):
    """The plans serve handed its supervisor, which in this process starts nothing (see the module's docstring)."""
    plans = []

    def supervise(the_plan, run_dir, run, log_format, vllm=None):
        plans.append(len(the_plan.processes))
        if run_dir._lock_fd is not None:  # the deployment is held until this process exits: not in a test
            os.close(run_dir._lock_fd)
            run_dir._lock_fd = None
        return 0, None

    class Flags:  # every flag but the unknown ones of UNKNOWN
        def __contains__(self, flag):
            return flag not in UNKNOWN

    def no_sleep(seconds):  # `ps --watch` and `logs -f` end at their first wait, as on Ctrl-C
        raise KeyboardInterrupt

    import vsup.cli.ps
    import vsup.cli.serve
    import vsup.log_query
    import vsup.vllm.launch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vsup.cli.serve, "supervise", supervise)
        patch.setattr(vsup.cli.serve, "default_model", lambda *_: str(world / "good"))
        patch.setattr(vsup.vllm.launch, "serve_flags", lambda binary, env: Flags())
        patch.setattr(vsup.cli.ps, "time", SimpleNamespace(time=time.time, sleep=no_sleep))
        patch.setattr(vsup.log_query, "time", SimpleNamespace(time=time.time, sleep=no_sleep))
        yield plans


def prepared(invocation: Invocation, world: Path, config_dir: Path) -> tuple[list[str], dict[str, str | None]]:
    """argv and environment with their places filled in, the config file written; every other variable unset."""
    config = str(config_dir / f"deploy{invocation.config[0]}") if invocation.config else str(world / "nowhere.toml")
    if invocation.config:
        Path(config).write_text(invocation.config[1], encoding="utf-8", errors="surrogateescape")

    def fill(text: str) -> str:
        return text.replace("{world}", str(world)).replace("{config}", config)

    env: dict[str, str | None] = {name: None for name in VARIABLES}
    env.update({k: fill(v) for k, v in invocation.env.items()})
    env["CUDA_VISIBLE_DEVICES"] = ""
    return [fill(a) for a in invocation.argv], env


def check_result(argv, code: int, stdout: str, stderr: str) -> None:
    said = f"argv={argv}\nexit {code}\nstdout: {stdout[-2000:]}\nstderr: {stderr[-3000:]}"
    assert "Traceback" not in stdout + stderr, said
    assert "internal error" not in stderr, said
    assert code in (0, 1, 2), said
    if code:
        assert stderr.endswith("\n") and stderr.count("\n") == 1, said
        assert NAMES_A_THING.search(stderr), said
    event(f"exit {code}")


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(invocation=invocations())
# the two cases, and what this test found (each was a traceback, or a hang building a plan)
@example(invocation=Invocation(["serve", "{world}/good"], {"VSUP_HOME": "/proc/nope"}))
@example(invocation=Invocation(["serve", "{world}/no-tokenizer"]))
@example(invocation=Invocation(["serve", "--headless", "-dp", "2", "--dp-start-rank", "1"]))
@example(invocation=Invocation(["serve", "{world}/good", "--host", "\x80"]))
@example(invocation=Invocation(["logs", "--since", "99999999999999d"]))
@example(invocation=Invocation(["plan", "{world}/good", "--kv-cache-memory", "9" * 400]))
@example(invocation=Invocation(["plan", "-tp", "9" * 30]))
@example(invocation=Invocation(["plan", "--engine", "vllm", "--replicas", "100000"]))
def test_no_input_gets_a_traceback(invocation, world, reached, tmp_path_factory):
    config_dir = tmp_path_factory.mktemp("config", numbered=True)
    argv, env = prepared(invocation, world, config_dir)
    before = len(reached)
    with CliRunner().isolation(env=env) as (out, err, _):
        code = execute(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    if len(reached) > before:
        event(f"serve reached its supervisor ({reached[-1]} processes)")
    check_result(argv, code, stdout, stderr)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(invocation=invocations())
def test_no_input_gets_a_traceback_in_a_real_process(invocation, world, tmp_path_factory):
    argv, env = prepared(invocation, world, tmp_path_factory.mktemp("config", numbered=True))
    env.update(VSUP_HOME=str(world / "file" / "home"), XDG_STATE_HOME=None)  # serve refuses it first
    full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    result = subprocess.run([sys.executable, "-m", "vsup", *argv], env=full, capture_output=True, text=True,
                            timeout=60, errors="replace")
    check_result(argv, result.returncode, result.stdout, result.stderr)
