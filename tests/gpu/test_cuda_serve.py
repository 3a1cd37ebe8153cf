"""`vsup serve` on one GPU, as an operator runs it: `--device auto` picks cuda, the worker holds the
memory that `--gpu-memory-utilization` planned, and greedy tokens equal transformers' on the same GPU.

One deployment (TP = 1) of tests/gpu/model.py's model for the module; its console, its log and
`vsup ps --json` go to the check's output folder.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from tests.gpu.conftest import OUT
from tests.local_deployment import free_port

VSUP = [sys.executable, "-m", "vsup"]
UTILIZATION = 0.2  # of the GPU's memory, for weights and KV cache: leaves room for the transformers reference
NEW_TOKENS = 48
_rng = random.Random(0)
# 16 prompts of token ids (3..255: not <unk>, <s>, </s>), 1 to 300 long, all at once: decode batches of mixed
# lengths across many blocks, prefill chunks beside decodes
PROMPTS = [[_rng.randrange(3, 256) for _ in range(n)] for n in [1, 2, 15, 16, 17, 31, 33, 64, 100, 127, 128, 129,
                                                                  200, 255, 299, 300]]
GIB = 2**30


def nvidia_smi(*query: str) -> list[list[str]]:
    """nvidia-smi's CSV rows for `query`; [] where it is missing."""
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=30).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


def used_mib() -> int | None:
    rows = nvidia_smi("--query-gpu=memory.used", "--id=0")
    return int(rows[0][0]) if rows else None


def plan(*args: str) -> dict:
    result = subprocess.run([*VSUP, "plan", *args, "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def server(cuda, gpu_model, tmp_path_factory):
    """`vsup serve MODEL --device auto --gpu-memory-utilization 0.2`, ready; stopped (SIGTERM) at the end."""
    home = tmp_path_factory.mktemp("home")
    port = free_port()
    env = {**os.environ, "VSUP_HOME": str(home)}
    baseline = used_mib()
    console = home / "console.log"
    with open(console, "wb") as log:
        proc = subprocess.Popen([*VSUP, "serve", str(gpu_model), "--device", "auto", "--gpu-memory-utilization",
                                 str(UTILIZATION), "--port", str(port), "--name", "gpu-check",
                                 "--served-model-name", "tiny", "--log-format", "json"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    s = SimpleNamespace(url=f"http://127.0.0.1:{port}", proc=proc, env=env, baseline_mib=baseline,
                        started=time.monotonic())
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"vsup serve exited {proc.returncode}:\n{console.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not serving within 300 s:\n{console.read_text()[-4000:]}"
            try:
                if httpx.get(f"{s.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        s.ready_s = time.monotonic() - s.started
        yield s
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if os.environ.get(OUT):
            shutil.copy(console, Path(os.environ[OUT]) / "serve-console.log")
            jsonl = home / "gpu-check" / "logs" / "vsup.jsonl"
            if jsonl.exists():
                shutil.copy(jsonl, Path(os.environ[OUT]) / "serve-vsup.jsonl")
    assert proc.returncode == 0, f"vsup serve did not stop cleanly ({proc.returncode}):\n{console.read_text()[-4000:]}"


def vsup(s, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*VSUP, *args, "--name", "gpu-check"], capture_output=True, text=True, timeout=60, env=s.env)


def test_plan_device_auto_sees_the_gpu(cuda, gpu_model, figures):
    bare = plan("--device", "auto")
    assert [p["device"] for p in bare["processes"] if p["role"] == "worker"] == ["cuda:0"]
    memory = plan(str(gpu_model), "--device", "auto", "--gpu-memory-utilization", str(UTILIZATION))["memory"]
    worker = memory["workers"][0]
    total = torch.cuda.get_device_properties(cuda).total_memory
    planned = worker["weight_bytes"] + worker["kv_cache_bytes"]
    figures("plan", {"gpu_total_bytes_torch": total, "planned_worker_bytes": planned, "memory": memory,
                     "share_of_gpu": planned / total})
    assert memory["dtype"] == "float32"  # the checkpoint's own dtype, as --dtype auto means on CUDA
    # the planner reads the GPU's size from nvidia-smi, torch from the driver: they agree within 2%
    assert abs(planned / total - UTILIZATION) < 0.02 * UTILIZATION, (planned, total)


def greedy_ids(url: str, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return [int(t.removeprefix("token_id:")) for t in response.json()["choices"][0]["logprobs"]["tokens"]]


def transformers_greedy(model_dir: Path, device: torch.device, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' argmax tokens (a full forward per token, float32, on `device`), and at each the gap
    between the best and second-best logit: how near a tie each choice was."""
    from transformers import AutoModelForCausalLM

    model = _models.get(model_dir) or AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    _models[model_dir] = model.eval()
    ids, gaps = list(prompt), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids], device=device)).logits[0, -1]
            top = logits.topk(2).values
            gaps.append((top[0] - top[1]).item())
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], gaps


_models: dict = {}


def test_greedy_tokens_equal_transformers_on_the_gpu(server, cuda, gpu_model, figures):
    start = time.monotonic()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: batched decode over mixed lengths
        served = list(pool.map(lambda p: greedy_ids(server.url, p), PROMPTS))
    served_s = time.monotonic() - start
    reference = [transformers_greedy(gpu_model, cuda, p) for p in PROMPTS]
    differ = {}
    for i, (ours, (theirs, gaps)) in enumerate(zip(served, reference)):
        if ours != theirs:
            at = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            differ[f"prompt {i} ({len(PROMPTS[i])} tokens)"] = {"first_difference_at": at, "served": ours[at],
                                                                "transformers": theirs[at],
                                                                "transformers_top2_logit_gap": gaps[at]}
    figures("serve_greedy_parity", {"prompts": len(PROMPTS), "new_tokens": NEW_TOKENS, "served_s": served_s,
                                    "ready_s": server.ready_s, "equal": len(PROMPTS) - len(differ), "differ": differ,
                                    "smallest_top2_gap": min(min(g) for _, g in reference)})
    assert not differ, f"greedy tokens differ from transformers': {differ}"


def test_the_worker_holds_what_the_plan_gave_it(server, cuda, gpu_model, figures):
    planned = plan(str(gpu_model), "--device", "auto", "--gpu-memory-utilization", str(UTILIZATION))["memory"]
    planned = planned["workers"][0]
    records = [json.loads(line) for line in vsup(server, "logs", "--role", "worker", "--json").stdout.splitlines()
               if line.startswith("{")]
    ready = next(r for r in records if r.get("event") == "ready")
    allocated = next(r for r in records if r.get("event") == "kv cache allocated")
    ps = json.loads(vsup(server, "ps", "--json").stdout)
    worker = next(p for p in ps["processes"] if p["role"] == "worker")
    per_process = {int(row[0]): int(row[1]) for row in nvidia_smi("--query-compute-apps=pid,used_memory")
                   if row[0].isdigit() and row[1].isdigit()}
    device_used = used_mib()
    held = per_process.get(worker["pid"])
    if held is None and device_used is not None and server.baseline_mib is not None:
        held = device_used - server.baseline_mib  # pids hidden (a container): the GPU's use since the start
    ps_memory = {k: v for k, v in worker.items() if "mem" in k and k != "rss_bytes"}
    figures("memory", {"planned": planned, "worker_ready": ready, "kv_cache_allocated": allocated,
                       "worker_device_mib": held, "worker_pid_seen_by_nvidia_smi": worker["pid"] in per_process,
                       "device_used_mib": device_used, "baseline_mib": server.baseline_mib,
                       "ps_worker": worker, "ps_device_memory_fields": ps_memory})
    if os.environ.get(OUT):
        (Path(os.environ[OUT]) / "ps.json").write_text(json.dumps(ps, indent=2) + "\n")
    assert worker["device"] == "cuda:0" and worker["state"] == "ready"
    # the planner's weights are what the worker loaded (on the GPU no oneDNN-packed copies add to them)
    assert abs(ready["weight_bytes"] - planned["weight_bytes"]) <= 0.01 * planned["weight_bytes"]
    # the cache is whole blocks of the planned bytes
    kv_cache = allocated["kv_cache_bytes"]
    assert planned["kv_cache_bytes"] - ready["kv_bytes_per_block"] < kv_cache <= planned["kv_cache_bytes"]
    assert held is not None, "nvidia-smi cannot tell the GPU memory in use"
    usable = planned["weight_bytes"] + planned["kv_cache_bytes"]
    # above the cache, within the utilization plus what a CUDA context, activations and Triton take (< 2 GiB)
    assert kv_cache <= held * 2**20 <= usable + 2 * GIB, (held, usable)
