"""The README's tour and the docs' examples, run as written, so that what they show cannot drift from what
vsup does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.tour import (README, by_process, mask, run_tour, shell, tour_env, tour_section, two_cpus,
                            written_in_bfloat16)
from tests.local_deployment import free_port

DOCS = sorted((Path(__file__).parents[2] / "docs").glob("*.md"))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from engine.model.default_model import default_model_dir

    default_model_dir()  # the examples of a model directory read it from the user's cache
    return tour_env(str(tmp_path_factory.mktemp("home")))


@pytest.mark.skipif(len(two_cpus().split(",")) < 2, reason="the examples are of a 2-CPU host")
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_console_examples_print_what_they_say(doc, env):
    """Each `console` block's `$ command` of a doc, on two CPUs (plan's CPU column depends on them); the
    output compared exactly."""
    examples = [(c.rstrip("\n").split("\n", 1) + [""])[:2]
                for block in re.findall(r"```console\n(.*?)```", doc.read_text(), flags=re.S)
                for c in block.split("$ ")[1:]]
    for command, expected in examples:
        result = shell(command, env)
        printed = (result.stdout + result.stderr).rstrip("\n")
        assert [line.rstrip() for line in printed.splitlines()] == [line.rstrip() for line in expected.splitlines()], \
            command


@pytest.mark.skipif(len(two_cpus().split(",")) < 2, reason="the tour is of a 2-CPU host")
@pytest.mark.timeout(900)  # a start of up to 600 s on a slow machine, then the tour
def test_the_readme_tour_prints_what_it_shows(env):
    """Every command of the tour, in order, beside a real `vsup serve`: each output equals the README's but
    for what `mask` masks; `vsup serve`'s console, process by process (processes interleave as they run)."""
    from vsup.devices import cpu_computes_bfloat16

    readme = README.read_text()
    other_cpu = written_in_bfloat16(readme) != cpu_computes_bfloat16()  # (then mask what precision decides)
    _, tour, _ = tour_section(readme)
    done = run_tour(env, tour, str(free_port()))
    kinds = [kind for kind, _, _ in done]
    assert kinds == ["console", "console", "sh", "console", "console", "console"], kinds
    for kind, examples, results in done:
        for example, result in zip(examples, results, strict=True):
            assert result.returncode == 0, (example.command, result.stdout, result.stderr)
            if kind == "sh":
                continue
            printed = mask(result.stdout + result.stderr, other_cpu)
            if example.command.startswith("vsup serve"):
                assert by_process(printed) == by_process(mask(example.output, other_cpu)), example.command
            else:
                assert printed == mask(example.output, other_cpu), example.command
    answers = done[2][2]
    assert "The capital of France is Paris." in answers[0].stdout  # curl's JSON
    assert answers[1].stdout.strip() == "The capital of France is Paris."  # the OpenAI client's


def test_the_mask_hides_only_what_changes_from_run_to_run():
    """The mask itself: pids, uptimes, ports, CPU%, RSS, load and durations go; names, states, restarts, last
    exits, CPUs, devices and device memory stay, so a wrong one fails the tour; on a CPU whose default precision
    is not the README's, the dtypes and what they size go too."""
    shown = """default: serving M on http://127.0.0.1:8000 (supervisor pid 1, up 4s)
NAME                     PID  STATE    UPTIME  RESTARTS  LAST EXIT  CPU%  CPUS  RSS       DEVICE  DEV MEM  LOAD
└── worker dp0 pp0 tp0   11   ready    4s      1         -          3     0     1.0 GiB   cpu     1.6 GiB  forward 1%"""
    same = """default: serving M on http://127.0.0.1:41234 (supervisor pid 9999, up 1m2s)
NAME                     PID     STATE    UPTIME  RESTARTS  LAST EXIT  CPU%  CPUS  RSS        DEVICE  DEV MEM  LOAD
└── worker dp0 pp0 tp0   123456  ready    1m2s    1         -          100   0     900.0 MiB  cpu     1.6 GiB  forward 0%"""
    assert mask(shown) == mask(same)
    for wrong in (same.replace("1.6 GiB", "64.8 MiB"), same.replace("  1         -", "  0         -"),
                  same.replace("ready ", "failed"), same.replace("  0     900", "  1     900")):
        assert mask(shown) != mask(wrong)
    f32 = "worker dp0 pp0 tp0 | model loaded linear_dtype=float32 weight_bytes=651306240 num_blocks=1456"
    bf16 = "worker dp0 pp0 tp0 | model loaded linear_dtype=bfloat16 weight_bytes=382346496 num_blocks=2912"
    assert mask(f32) != mask(bf16) and mask(f32, precision=True) == mask(bf16, precision=True)  # (another CPU's)
    assert mask(shown) != mask(same.replace("1.6 GiB", "1.4 GiB")) and \
        mask(shown, precision=True) == mask(same.replace("1.6 GiB", "1.4 GiB"), precision=True)
    assert mask("worker dp0 pp0 tp0 | model loaded seconds=0.63 weight_bytes=651306240") == \
        mask("worker dp0 pp0 tp0 | model loaded seconds=1.2 weight_bytes=651306240") != \
        mask("worker dp0 pp0 tp0 | model loaded seconds=1.2 weight_bytes=1")


def test_every_doc_the_readme_links_exists():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links and all((README.parent / link).is_file() for link in links), links
