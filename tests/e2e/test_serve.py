"""`vsup serve` as an operator runs it: the real supervisor, engine and API server, the official client."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from engine.ring.shm_broadcast import ShmBroadcastWriter
from tests.conftest import held_shm
from tests.e2e.served import VSUP, Streams, complete, complete_all, mid_stream
from tests.polling import wait_for
from vsup.addresses import ring_prefix


@pytest.mark.parametrize("flags", [[], ["-tp", "2"], ["-pp", "2"], ["-dp", "2"], ["--no-multiprocessing", "-tp", "2"]],
                         ids=["tp1", "tp2", "pp2", "dp2", "inproc-tp2"])
def test_ps_shows_exactly_the_plan(serve, model, flags):
    s = serve(*flags)
    state = s.wait_serving()
    plan = json.loads(subprocess.run([*VSUP, "plan", model, "--device", "cpu", "--json", *flags],
                                     capture_output=True, text=True).stdout)
    assert [p["name"] for p in state["processes"]] == [p["name"] for p in plan["processes"]]
    assert len(complete(s.client, "hello", n=8, stream=False)) > 0
    drawn = subprocess.run([*VSUP, "plan", model, "--device", "cpu", *flags], capture_output=True, text=True).stdout
    assert tree_of(s.vsup("ps").stdout) == tree_of(drawn)  # the same glyphs, names and nesting
    pids = list(s.pids().values())
    code, out, err = s.stop()
    assert code == 0, err
    assert not [pid for pid in pids if psutil.pid_exists(pid)]


def test_bfloat16_linears_reach_the_worker(serve):
    """--linear-dtype bfloat16 (a CPU with avx512_bf16 or AMX): the worker loads a float32 model whose linears
    are packed in bfloat16, and it serves."""
    from vsup.devices import cpu_computes_bfloat16

    if not cpu_computes_bfloat16():
        pytest.skip("this CPU has no avx512_bf16 (vsup plan's test checks the refusal)")
    s = serve("--linear-dtype", "bfloat16")
    s.wait_serving()
    assert len(complete(s.client, "hello", n=8, stream=False)) > 0
    loaded = [json.loads(line) for line in s.vsup("logs", "--role", "worker", "--json").stdout.splitlines()
              if '"model loaded"' in line]
    assert [(r["dtype"], r["linear_dtype"]) for r in loaded] == [("float32", "bfloat16")]
    pids = list(s.pids().values())
    code, _, err = s.stop()
    assert code == 0, err
    assert not [pid for pid in pids if psutil.pid_exists(pid)]


@pytest.mark.parametrize("flags", [[], ["--no-multiprocessing"]], ids=["core-process", "inproc"])
def test_a_bfloat16_kv_cache_reaches_the_worker(serve, model, flags):
    """--kv-cache-dtype bfloat16: the worker (in-process: the API server, which holds it) stores K and V in
    bfloat16, in twice the blocks of a float32 cache of the same --kv-cache-memory, and it serves."""
    s = serve("--kv-cache-dtype", "bfloat16", *flags)
    s.wait_serving()
    assert len(complete(s.client, "hello", n=8, stream=False)) > 0
    role = "api-server" if flags else "worker"
    records = [json.loads(line) for line in s.vsup("logs", "--role", role, "--json").stdout.splitlines()]
    loaded = [r for r in records if r.get("event") == "model loaded"]
    allocated = [r for r in records if r.get("event") == "kv cache allocated"]
    assert [(r["dtype"], r["kv_cache_dtype"]) for r in loaded] == [("float32", "bfloat16")]
    shape = json.loads((Path(model) / "config.json").read_text())
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    block_bytes = 2 * shape["num_hidden_layers"] * 16 * shape["num_key_value_heads"] * head_dim * 2  # K, V in bf16
    assert [r["kv_cache_bytes"] // r["num_blocks"] for r in allocated] == [block_bytes]
    pids = list(s.pids().values())
    code, _, err = s.stop()
    assert code == 0, err
    assert not [pid for pid in pids if psutil.pid_exists(pid)]


def tree_of(text: str) -> list[str]:
    """The tree's rows (glyphs and name) of `vsup plan`'s or `vsup ps`'s output, from its root on."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("supervisor (vsup serve)"))
    rows = ["supervisor (vsup serve)"]
    for line in lines[start + 1:]:
        if not line.startswith(("├", "└", "│", "    ")):
            break
        rows.append(re.match(r"^(.*?\S)(?:\s{2,}|$)", line)[1])
    return rows


def test_chaos_every_request_finishes_with_the_same_tokens(serve):
    s = serve("-dp", "2", kv_cache_memory="8MiB")  # room for every stream at once (4 MiB held half of them back)
    s.wait_serving()
    prompts = [f"the {i} way" for i in range(64)]
    # long enough for three faults, each once the streams went on after the last
    reference = complete_all(s.client, prompts, n=160)

    def faults(streams):
        counts = None
        for name in ("worker dp0 pp0 tp0", "engine-core dp1", "coordinator"):
            counts = mid_stream(streams, f"the kill of {name}", after=counts)
            os.kill(s.pids()[name], signal.SIGKILL)

    assert complete_all(s.client, prompts, n=160, during=faults) == reference
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
    s = serve()
    s.wait_serving()
    pids = list(s.pids().values())
    reference = complete(s.client, "long story", n=200)
    stream = Streams(s.client, ["long story"], n=200)
    mid_stream(stream, "SIGTERM")
    s.proc.send_signal(signal.SIGTERM)
    texts = stream.texts()
    code, out, err = s.stop()
    assert code == 0, err
    assert texts == [reference]  # it ran to its end instead of being cut
    assert not [pid for pid in pids if psutil.pid_exists(pid)]
    assert not [n for n in set(os.listdir("/dev/shm")) - held_shm() if n.startswith("vsup-e2e-")]


DEAD_WRITER = """
import os, sys
from engine.ring.shm_broadcast import ShmBroadcastWriter
ShmBroadcastWriter.create(sys.argv[1], 1, sys.argv[2])
os._exit(0)  # gone without removing it, as a killed engine core
"""


def test_a_stop_removes_only_the_rings_whose_writer_is_gone(serve, tmp_path):
    """A deployment of the same name under another VSUP_HOME has step rings of the same /dev/shm
    prefix, named there until its workers attach (this test process stands for it: an in-process
    test failed so when another test's deployment "e2e" stopped beside it). At stop the supervisor
    removes the rings of its name whose writer is gone, and only those: not those of a deployment whose
    name starts with its own and "-dp"."""
    s = serve()
    s.wait_serving()
    live = ShmBroadcastWriter.create(ring_prefix(s.name, 0), 1, f"ipc://{tmp_path}/live.sock")

    def dead_ring(prefix: str) -> str:
        before = set(os.listdir("/dev/shm"))
        subprocess.run([sys.executable, "-c", DEAD_WRITER, prefix, f"ipc://{tmp_path}/dead.sock"], check=True,
                       timeout=60)
        (name,) = set(os.listdir("/dev/shm")) - before
        return name

    dead = [dead_ring(ring_prefix(s.name, 1))]
    dead.append(dead_ring(ring_prefix(f"{s.name}-dp3", 0)))  # another deployment's, gone too
    try:
        assert s.stop()[0] == 0
        assert (Path("/dev/shm") / live.name).exists(), "the stop removed a ring whose writer is alive"
        assert not (Path("/dev/shm") / dead[0]).exists(), "the stop left a ring whose writer is gone"
        assert (Path("/dev/shm") / dead[1]).exists(), "the stop removed another deployment's ring"
    finally:
        live.close()
        for name in dead:
            (Path("/dev/shm") / name).unlink(missing_ok=True)


def test_killed_supervisor_leaves_nothing_behind(serve):
    s = serve("-tp", "2")
    s.wait_serving()
    pids = list(s.pids().values())
    s.proc.kill()
    s.proc.communicate()
    wait_for(lambda: not [pid for pid in pids if psutil.pid_exists(pid)
                          and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE],
             timeout=2.0, what="the tree gone within 2 s of its supervisor")


@pytest.mark.parametrize("flags", [[], ["--no-multiprocessing"]], ids=["core-process", "inproc"])
def test_weights_that_cannot_load_end_the_deployment_quoting_the_error(serve, model, tmp_path, flags):
    """Bytes past the last tensor of a safetensors file (which vsup's header checks let by) fail the worker's
    load at every start. In-process the API server holds the engine core and its worker: it exits then, as a
    worker process does, rather than serve without a core for ever; so the supervisor restarts it with its
    backoff and, at the start limit, ends quoting the error."""
    broken = tmp_path / "broken-model"
    shutil.copytree(model, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes() + b"trailing")
    s = serve(*flags, "--max-restarts", "1", model_dir=str(broken))
    out, err = s.proc.communicate(timeout=120)
    assert s.proc.returncode == 1, err
    assert "1 restarts within" in err and "file not fully covered" in err, err
