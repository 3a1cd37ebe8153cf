"""`vsup serve` as an operator runs it: the real supervisor, engine and API server, the official client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from engine.api_server.local_deployment import free_port, with_test_tokenizer

VSUP = [sys.executable, "-m", "vsup"]


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    return str(with_test_tokenizer(tiny_model("llama_tied"), tmp_path_factory.mktemp("tiny-with-tokenizer")))


class Served:
    """One `vsup serve` subprocess in its own VSUP_HOME.

    Its stdout is read only at the end, on purpose: a console nobody reads
    (a full pipe) must not stall the supervisor, and the chaos test fills it."""

    def __init__(self, home, model, *flags, name="e2e"):
        self.home, self.name, self.port = str(home), name, free_port()
        self.env = {**os.environ, "VSUP_HOME": self.home}
        self.proc = subprocess.Popen([*VSUP, "serve", model, "--name", name, "--port", str(self.port),
                                      "--device", "cpu", "--kv-cache-memory", "4MiB", "--max-model-len", "256",
                                      "--log-format", "json", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0,
                                    timeout=120)

    def vsup(self, *args):
        return subprocess.run([*VSUP, *args, "--name", self.name], capture_output=True, text=True, timeout=60,
                              env=self.env)

    def ps(self):
        result = self.vsup("ps", "--json")
        return json.loads(result.stdout) if result.returncode == 0 else None

    def wait_serving(self, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read()
            state = self.ps()
            if state and state["supervisor"]["state"] == "serving" and all(
                    p["state"] == "ready" for p in state["processes"]):
                return state
            time.sleep(0.2)
        raise TimeoutError(f"not serving: {self.ps()}")

    def pids(self):
        return {p["name"]: p["pid"] for p in self.ps()["processes"]}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, out, err


@pytest.fixture
def serve(tmp_path, model):
    started = []

    def start(*flags, **kwargs):
        s = Served(tmp_path, model, *flags, **kwargs)
        started.append(s)
        return s

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.communicate()


def complete(client, prompt, n=24, stream=True):
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs)
                   if chunk.choices)


@pytest.mark.parametrize("flags", [[], ["-tp", "2"], ["-pp", "2"], ["-dp", "2"], ["--no-multiprocessing", "-tp", "2"]],
                         ids=["tp1", "tp2", "pp2", "dp2", "inproc-tp2"])
def test_ps_shows_exactly_the_plan(serve, model, flags):
    s = serve(*flags, "--served-model-name", "tiny")
    state = s.wait_serving()
    plan = json.loads(subprocess.run([*VSUP, "plan", model, "--device", "cpu", "--json", *flags],
                                     capture_output=True, text=True).stdout)
    assert [p["name"] for p in state["processes"]] == [p["name"] for p in plan["processes"]]
    assert len(complete(s.client, "hello", n=8, stream=False)) > 0
    pids = list(s.pids().values())
    code, out, err = s.stop()
    assert code == 0, err
    assert not [pid for pid in pids if psutil.pid_exists(pid)]


def test_chaos_every_request_finishes_with_the_same_tokens(serve):
    s = serve("-dp", "2", "--served-model-name", "tiny")
    s.wait_serving()
    prompts = [f"the {i} way" for i in range(64)]

    def run_all(faults=None):
        out = [None] * len(prompts)
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, complete(s.client, prompts[i], n=48)))
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        if faults:
            faults()
        for t in threads:
            t.join(timeout=300)
        return out

    reference = run_all()

    def faults():
        time.sleep(0.5)
        for name in ("worker dp0 pp0 tp0", "engine-core dp1", "coordinator"):
            os.kill(s.pids()[name], signal.SIGKILL)
            time.sleep(1.0)

    assert run_all(faults) == reference
    state = s.wait_serving()
    restarts = {p["name"]: p["restarts"] for p in state["processes"]}
    assert restarts["worker dp0 pp0 tp0"] == 1 and restarts["engine-core dp1"] == 1
    assert restarts["worker dp1 pp0 tp0"] == 1 and restarts["coordinator"] == 1  # a core brings its group
    assert restarts["engine-core dp0"] == 0 and restarts["api-server a0"] == 0
    metrics = httpx.get(f"http://127.0.0.1:{s.port}/metrics").text  # the supervisor's counts, by role
    for role, count in (("worker", 2), ("engine-core", 1), ("coordinator", 1), ("api-server", 0)):
        assert f'vsup_restarts_total{{role="{role}"}} {count}.0' in metrics
    assert s.stop()[0] == 0


def test_sigterm_lets_running_requests_finish(serve):
    s = serve("--served-model-name", "tiny")
    s.wait_serving()
    pids = list(s.pids().values())
    result = {}

    def long_request():
        result["response"] = s.client.completions.create(model="tiny", prompt="long story", max_tokens=200,
                                                         temperature=0, extra_body={"ignore_eos": True})
    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)
    s.proc.send_signal(signal.SIGTERM)
    thread.join(timeout=120)
    code, out, err = s.stop()
    assert code == 0, err
    response = result["response"]  # it ran to its end instead of being cut
    assert response.usage.completion_tokens == 200 and response.choices[0].finish_reason == "length"
    assert not [pid for pid in pids if psutil.pid_exists(pid)]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("vsup-e2e-")]


def test_killed_supervisor_leaves_nothing_behind(serve):
    s = serve("-tp", "2", "--served-model-name", "tiny")
    s.wait_serving()
    pids = list(s.pids().values())
    s.proc.kill()
    s.proc.communicate()
    time.sleep(2)
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive
