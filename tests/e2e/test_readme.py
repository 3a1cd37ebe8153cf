"""The README's commands, run as written, so that the README cannot drift from the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.local_deployment import free_port
from tests.polling import wait_for

README = Path(__file__).parents[2] / "README.md"
BIN = str(Path(sys.executable).parent)


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", README.read_text(), flags=re.S)


def shell(command: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from engine.model.default_model import default_model_dir

    default_model_dir()  # the README's plan example reads it from the user's cache
    return {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "VSUP_HOME": str(tmp_path_factory.mktemp("home"))}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the README's examples are of a 2-CPU host")
def test_console_examples_print_what_the_readme_says(env):
    """Each on two CPUs (taskset), as the README says: plan's CPU column depends on the host's CPUs."""
    two = ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))
    examples = []
    for block in blocks("console"):
        for chunk in block.split("$ ")[1:]:
            command, *output = chunk.rstrip("\n").split("\n")
            examples.append((command, "\n".join(output)))
    assert len(examples) >= 2
    for command, expected in examples:
        result = shell(f"taskset -c {two} {command}", env)
        printed = (result.stdout + result.stderr).rstrip("\n")
        assert [line.rstrip() for line in printed.splitlines()] == [line.rstrip() for line in expected.splitlines()], \
            command


@pytest.mark.timeout(900)  # a start of up to 600 s on a slow machine, then the tour
def test_the_quick_tour_does_what_it_says(env):
    port = str(free_port())
    tour = blocks("sh")[1].replace("8000", port)
    commands = [c for c in re.sub(r"\\\n\s*", " ", tour).split("\n") if c.strip()]
    python = next(i for i, c in enumerate(commands) if c.startswith('python -c "'))
    end = next(i for i in range(python + 1, len(commands)) if commands[i].endswith('"'))  # the multi-line python
    commands[python:end + 1] = ["\n".join(commands[python:end + 1])]
    serve = subprocess.Popen(["vsup", "serve", "--port", port], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)

    def serving():
        assert serve.poll() is None, serve.stdout.read()
        return "serving" in shell("vsup ps", env).stdout.split("\n")[0]

    try:
        wait_for(serving, timeout=600, what="vsup serve serving (its --startup-timeout is 600 s)", interval=0.5)
        results = {c.split()[0] + (" " + c.split()[1] if c.startswith("vsup") else ""): shell(c, env)
                   for c in commands}
        serve.wait(timeout=60)  # `vsup stop` returned: the supervisor is on its way out
    finally:
        if serve.poll() is None:
            serve.terminate()
        printed = serve.communicate(timeout=120)[0]
    assert all(r.returncode == 0 for r in results.values()), results
    assert "The capital of France is Paris." in results["curl"].stdout
    assert results["python"].stdout.strip() == "The capital of France is Paris."
    assert "serving SmolLM2-135M-Instruct" in results["vsup ps"].stdout
    worker_lines = results["vsup logs"].stdout.splitlines()
    assert worker_lines and all(line.startswith("worker dp0 pp0 tp0") for line in worker_lines)
    assert results["vsup stop"].stdout.startswith("stopped default")
    assert serve.returncode == 0, printed[-4000:]  # what the supervisor said of its end
