"""Fixtures of the e2e tests: the tiny model with a tokenizer, `vsup serve` subprocesses, and a stock
vLLM under vsup (tests/e2e/test_vllm*.py)."""

from __future__ import annotations

import pytest

from tests.e2e.served import Served
from tests.e2e.vllm_served import serve_default_model, vllm_bin_or_skip
from tests.local_deployment import with_test_tokenizer


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed e2e test shows the last lines of every deployment it could see: on a CI machine
    that is all there is to read afterwards."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for served in list(Served.instances):
            report.sections.append((f"vsup logs --name {served.name} -n 60", served.last_log_lines()))


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    return str(with_test_tokenizer(tiny_model("llama_tied"), tmp_path_factory.mktemp("tiny-with-tokenizer")))


@pytest.fixture
def serve(tmp_path, model):
    """serve(*flags, name=...) starts `vsup serve` of the tiny model; killed at the end if still running."""
    started = []

    def start(*flags, **kwargs):
        s = Served(tmp_path, kwargs.pop("model_dir", model), *flags, **kwargs)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


@pytest.fixture(scope="module")
def vllm_bin():
    return vllm_bin_or_skip()


@pytest.fixture(scope="module")
def vllm_deployment(vllm_bin, tmp_path_factory):
    """The default model under a stock vLLM, one deployment per module that asks (serve_default_model)."""
    s = serve_default_model(tmp_path_factory.mktemp("vllm-home"))
    yield s
    s.kill()
