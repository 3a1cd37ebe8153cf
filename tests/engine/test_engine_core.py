"""EngineCore in-process and EngineCoreProc as a real process with real workers and sockets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq

from engine.core.engine_core import EngineCore
from engine.core.scheduler_config import SchedulerConfig
from engine.executor.executor import InprocExecutor
from engine.wire.protocol import (AddRequest, Failed, Hello, Outputs, Ready, UtilityCall, UtilityResult, encoder,
                                  from_core)
from engine.wire.sampling_params import SamplingParams
from engine.worker.worker import WorkerConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = {"a": [5, 17, 42, 99, 3, 250, 7], "b": [11, 12, 13], "c": [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}


@pytest.fixture(scope="module")
def reference(tiny_model, hf_greedy):
    """transformers' greedy continuation of each prompt."""
    return hf_greedy(tiny_model("llama_tied"), {r: (p, 8) for r, p in PROMPTS.items()})


def test_in_process_core_greedy_and_bad_requests(tiny_model, reference):
    model_dir = str(tiny_model("llama_tied"))
    executor = InprocExecutor(WorkerConfig(model=model_dir, kv_cache_bytes=1 << 20, block_size=4))
    core = EngineCore(SchedulerConfig(num_blocks=executor.num_blocks, block_size=4, max_model_len=512,
                                      max_num_batched_tokens=8), executor, vocab_size=256)
    for r, p in PROMPTS.items():
        assert core.add_request(AddRequest(r, p, GREEDY)) is None
    bad_token = core.add_request(AddRequest("bad-token", [1, 256], GREEDY))
    bad_param = core.add_request(AddRequest("bad-param", [1, 2], SamplingParams(top_p=0.0)))
    assert bad_token.finish_reason == "error" and "[0, 256)" in bad_token.error
    assert bad_param.finish_reason == "error" and "top_p" in bad_param.error
    outputs = {r: [] for r in PROMPTS}
    finished = {}
    while core.has_work():
        for update in core.step():
            outputs[update.req_id] += update.new_token_ids
            if update.finish_reason:
                finished[update.req_id] = update.finish_reason
    assert outputs == reference and set(finished.values()) == {"length"}
    core.close()


class FakeApiServer:
    """The API server's end: a ROUTER the engine core connects to."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)

    def recv(self, kind, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                identity, raw = self.sock.recv_multipart()
                msg = from_core.decode(raw)
                if isinstance(msg, kind):
                    return msg
        raise TimeoutError(f"no {kind.__name__} within {timeout_s} s")

    def send(self, msg, raw: bytes | None = None):
        self.sock.send_multipart([b"dp0", raw if raw is not None else encoder.encode(msg)])

    def collect(self, req_ids, timeout_s=120.0, first: Outputs | None = None):
        outputs, reasons = {r: [] for r in req_ids}, {}
        while len(reasons) < len(req_ids):
            batch, first = first or self.recv(Outputs, timeout_s), None
            for update in batch.outputs:
                outputs[update.req_id] += update.new_token_ids
                if update.finish_reason:
                    reasons[update.req_id] = update.finish_reason
        return outputs, reasons

    def close(self):
        self.sock.close()
        self.ctx.term()


class Deployment:
    """One engine core and its workers, started the way the supervisor will start them."""

    def __init__(self, tmp: Path, model_dir: str, tp: int = 1, worker_timeout: float = 60.0,
                 kv_cache_bytes: int = 1 << 20, max_model_len: int = 256, pp: int = 1):
        self.tmp, self.model_dir, self.tp, self.pp, self.kv_cache_bytes = tmp, model_dir, tp, pp, kv_cache_bytes
        self.api = FakeApiServer(f"ipc://{tmp}/a0.sock")
        self.control = self.api.ctx.socket(zmq.PUSH)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.connect(f"ipc://{tmp}/control.sock")
        self.core = self.spawn([sys.executable, "-m", "engine.core", "--model", model_dir,
                                "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
                                "--api-server-address", f"ipc://{tmp}/a0.sock",
                                "--worker-address", f"ipc://{tmp}/workers.sock",
                                "--control-address", f"ipc://{tmp}/control.sock",
                                "--ring-prefix", f"vsup-test-{tmp.name}", "--wakeup-address", f"ipc://{tmp}/wake.sock",
                                "--block-size", "4", "--max-model-len", str(max_model_len), "--max-num-batched-tokens", "64",
                                "--worker-timeout", str(worker_timeout)])
        self.generation = 0
        self.workers = self.start_workers()

    def spawn(self, argv):
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def start_workers(self):
        self.generation += 1
        return [self.spawn([sys.executable, "-m", "engine.worker", "--model", self.model_dir,
                            "--tp-rank", str(r % self.tp), "--pp-rank", str(r // self.tp),
                            "--tensor-parallel-size", str(self.tp), "--pipeline-parallel-size", str(self.pp),
                            "--kv-cache-bytes", str(self.kv_cache_bytes),
                            "--block-size", "4", "--core-address", f"ipc://{self.tmp}/workers.sock",
                            "--dist-init-method", f"file://{self.tmp}/dist-{self.generation}", "--num-threads", "1"])
                for r in range(self.tp * self.pp)]

    def stop(self):
        for p in [self.core, *self.workers]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        logs = {}
        for p in [self.core, *self.workers]:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            logs[p.pid] = p.stdout.read().decode()
        self.control.close()
        self.api.close()
        return logs


@pytest.fixture
def deployment(tmp_path, tiny_model):
    started = []

    def start(**kwargs):
        d = Deployment(tmp_path, str(tiny_model("llama_tied")), **kwargs)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"vsup-test-{tmp_path.name}")]


def test_core_process_serves_with_a_tp2_group_and_survives_bad_input(deployment, reference):
    d = deployment(tp=2)
    hello = d.api.recv(Hello)
    ready = d.api.recv(Ready)
    assert hello.instance == ready.instance and ready.max_model_len == 256
    d.api.send(None, raw=b"\xc1 garbage")
    d.api.send(AddRequest("bad", [1, 999], GREEDY))
    for r, p in PROMPTS.items():
        d.api.send(AddRequest(r, p, GREEDY))
    outputs, reasons = d.api.collect([*PROMPTS, "bad"])
    assert reasons.pop("bad") == "error"
    outputs.pop("bad")
    assert outputs == reference
    d.api.send(UtilityCall(7, "get_stats"))
    stats = d.api.recv(UtilityResult)
    assert stats.call_id == 7 and stats.result["num_running"] == 0
    logs = d.stop()
    assert "dropped malformed message" in logs[d.core.pid]


def test_idle_core_does_not_spin(deployment):
    d = deployment()
    d.api.recv(Ready)
    proc = psutil.Process(d.core.pid)
    before = sum(proc.cpu_times()[:2])
    time.sleep(1.5)
    assert sum(proc.cpu_times()[:2]) - before < 0.1


def test_killed_worker_group_is_replaced_and_requests_finish_alike(deployment, reference):
    d = deployment()
    d.api.recv(Ready)
    d.api.send(AddRequest("long", PROMPTS["a"], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)))
    for r, p in PROMPTS.items():
        d.api.send(AddRequest(r, p, GREEDY))
    first = d.api.recv(Outputs)  # stepping has begun
    d.workers[0].kill()  # kill -9, mid-generation
    d.workers[0].wait()
    d.workers = d.start_workers()
    outputs, reasons = d.api.collect([*PROMPTS, "long"], first=first)
    assert len(outputs.pop("long")) == 200 and set(reasons.values()) == {"length"}
    assert outputs == reference
    assert "worker group lost" in d.stop()[d.core.pid]


def test_supervisor_message_makes_the_core_drop_its_group(deployment):
    d = deployment()
    d.api.recv(Ready)
    # vsup speaks the control protocol as a plain msgpack map: it never imports the engine
    d.control.send(msgspec.msgpack.encode({"type": "workers_lost", "reason": "worker exited"}))
    for p in d.workers:  # the supervisor ends the old group
        p.kill()
        p.wait()
    d.workers = d.start_workers()
    d.api.send(AddRequest("b", PROMPTS["b"], GREEDY))
    outputs, reasons = d.api.collect(["b"])
    assert reasons == {"b": "length"} and len(outputs["b"]) == 8
    assert "worker exited" in d.stop()[d.core.pid]


def test_group_that_never_returns_fails_the_core(deployment):
    d = deployment(worker_timeout=2.0)
    d.api.recv(Ready)
    d.api.send(AddRequest("b", PROMPTS["b"], GREEDY))
    for p in d.workers:
        p.kill()
        p.wait()
    failed = d.api.recv(Failed, timeout_s=30)
    assert "did not come back within 2 s" in failed.error
    assert d.core.wait(timeout=30) == 1


def mixed_requests(n=32, seed=0):
    """n prompts of 3 to 24 tokens, each asking for 4 to 16 greedy tokens."""
    import random
    rng = random.Random(seed)
    return {f"r{i}": ([rng.randrange(256) for _ in range(rng.randint(3, 24))], rng.randint(4, 16)) for i in range(n)}


@pytest.fixture(scope="module")
def mixed_reference(tiny_model, hf_greedy):
    return hf_greedy(tiny_model("llama_tied"), mixed_requests())


@pytest.mark.parametrize("kv_cache_bytes,preempts", [(1 << 20, False), (64 << 10, True)])
def test_32_concurrent_requests_through_tp2_equal_generate(deployment, mixed_reference, kv_cache_bytes, preempts):
    # 64 KiB per worker: 32 blocks of 4 tokens (2 KiB each at TP=2), far fewer than 32 requests need at once
    d = deployment(tp=2, kv_cache_bytes=kv_cache_bytes, max_model_len=64)
    assert d.api.recv(Ready).num_blocks == kv_cache_bytes // 2048
    for r, (p, n) in mixed_requests().items():
        d.api.send(AddRequest(r, p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
    outputs, reasons = d.api.collect(list(mixed_requests()))
    assert outputs == mixed_reference
    d.api.send(UtilityCall(1, "get_stats"))
    assert (d.api.recv(UtilityResult).result["num_preemptions"] > 0) == preempts


def test_pp2_core_process_keeps_two_batches_in_flight_and_equals_generate(deployment, mixed_reference):
    d = deployment(pp=2, max_model_len=64)
    d.api.recv(Ready)
    for r, (p, n) in mixed_requests().items():
        d.api.send(AddRequest(r, p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
    outputs, _ = d.api.collect(list(mixed_requests()))
    assert outputs == mixed_reference


class CountingExecutor:
    """An in-process executor that remembers the most steps it ever had in flight."""

    def __init__(self, inner):
        self.inner, self.num_blocks = inner, inner.num_blocks
        self.in_flight = self.most_in_flight = 0

    def submit(self, scheduler_output):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.inner.submit(scheduler_output)

    def wait(self, step_id):
        self.in_flight -= 1
        return self.inner.wait(step_id)

    def close(self):
        self.inner.close()


def test_two_batches_in_flight_give_the_same_tokens(tiny_model, mixed_reference):
    executor = CountingExecutor(InprocExecutor(WorkerConfig(model=str(tiny_model("llama_tied")),
                                                            kv_cache_bytes=1 << 20, block_size=4)))
    core = EngineCore(SchedulerConfig(num_blocks=executor.num_blocks, block_size=4, max_model_len=64,
                                      max_num_batched_tokens=64), executor, vocab_size=256, num_batches_in_flight=2)
    for r, (p, n) in mixed_requests().items():
        assert core.add_request(AddRequest(r, p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))) is None
    outputs = {r: [] for r in mixed_requests()}
    while core.has_work():
        for update in core.step():
            outputs[update.req_id] += update.new_token_ids
    assert outputs == mixed_reference
    assert executor.most_in_flight == 2
    core.close()
