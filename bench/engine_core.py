"""EngineCore throughput against transformers, its step overhead, the ring's round trip, and
a real core process plus worker process against the in-process core, side by side in one run.

On SmolLM2-135M-Instruct (float32, CPU, the same torch thread count everywhere):

(a) throughput: C concurrent requests (short prompts of mixed lengths, greedy, ignore_eos, the
    same number of output tokens each) through an in-process EngineCore (InprocExecutor), against
    transformers `generate` on one padded batch (left padding) and one request at a time. Ours
    and the batch run interleaved step by step: a logits processor runs one EngineCore step
    after each of generate's forwards, and each side is charged only its own time. "e2e" counts
    from submission to the last token; "decode" from the moment every request has its first
    token (ours: the end of that step; HF: its first logits-processor call) to the end.
    Sequential HF runs each request alone, so its rate does not depend on C: it is measured on a
    few requests and shown on every row.
(b) step overhead at batch 16: EngineCore.step() (schedule, execute, update) against the
    Worker.execute inside it on the same SchedulerOutput, paired step by step. Goal <= 1.15.
(c) ring round trip: a SchedulerOutput's bytes to an echo process and back over two rings
    (bench/ring_buffer.py's echo), median and p99. Goal <= 100 us.
(d) multiprocess: `python -m engine.core` plus one `python -m engine.worker`, driven through a
    ROUTER socket as an API server would, against the in-process core on the same prompts,
    alternating. Goal: multiprocess / in-process >= 0.95.

    python bench/engine_core.py --quick      # about 45 s on a quiet 2-core machine
    python bench/engine_core.py              # full (about 7 min): 64 output tokens, more rounds
    python bench/engine_core.py --smoke      # seconds: 1 and 2 requests of 4 tokens, every part
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
import zmq
from transformers import AutoModelForCausalLM

from common import (REPO_ROOT, Children, add_mode_args, median_ms, mode, percentile, print_table, ratio, setup,
                    timed, write_results)
from engine.core.engine_core import EngineCore
from engine.core.scheduler_config import SchedulerConfig
from engine.executor.executor import InprocExecutor
from engine.ring.shm_broadcast import ShmBroadcastReader, ShmBroadcastWriter
from engine.model.config import ModelConfig, eos_token_ids
from engine.model.default_model import default_model_dir
from engine.wire.protocol import AddRequest, Failed, Outputs, Ready, encoder, from_core
from engine.wire.sampling_params import SamplingParams
from engine.wire.scheduler_output import CachedRequest, SchedulerOutput
from engine.wire.worker_messages import encoder as ring_encoder
from engine.worker.worker import WorkerConfig
from ring_buffer import ring_echo

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 512 << 20
PROMPT_LENS = (8, 40)  # short prompts, lengths drawn uniformly from this range


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_args(p)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads, in-process and in the worker")
    p.add_argument("--concurrency", default="1,16,64", help="(a) concurrent requests, comma-separated")
    p.add_argument("--output-tokens", type=int, default=None, help="per request (quick 16, full 64)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds of (a) and (d) (quick 1; full: 2 for (a), 4 for (d))")
    p.add_argument("--hf-sequential", type=int, default=None, help="requests run alone for HF one-at-a-time "
                   "(quick 2, full 4)")
    p.add_argument("--trips", type=int, default=None, help="(c) ring round trips per payload (quick 1000, full 5000)")
    p.add_argument("--parts", default="a,b,c,d", help="which parts to run")
    p.add_argument("--mp-concurrency", type=int, default=None, help="(d) concurrent requests (smoke 2, else 32)")
    args = p.parse_args(argv)
    args.mode = mode(args)
    if args.mode == "smoke":  # seconds: 1 and 2 requests of 4 tokens, 20 ring trips, (d) on 2 requests
        args.concurrency, args.output_tokens, args.hf_sequential = "1,2", args.output_tokens or 4, 1
        args.trips, args.mp_concurrency = args.trips or 20, args.mp_concurrency or 2
    args.mp_concurrency = args.mp_concurrency or 32
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.output_tokens = args.output_tokens or (16 if args.quick else 64)
    args.hf_sequential = args.hf_sequential or (2 if args.quick else 4)
    args.trips = args.trips or (1000 if args.quick else 5000)
    args.parts = set(args.parts.split(","))
    return args


def clocks() -> tuple[float, float]:
    """(wall, CPU of this process) seconds, now."""
    return time.perf_counter(), time.process_time()


def make_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(*PROMPT_LENS))] for _ in range(n)]


# ours, in process


class InprocEngine:
    """One InprocExecutor (the model loaded once); each run gets a fresh EngineCore, so no run
    hits the prefix cache of another."""

    def __init__(self, model_dir: str, num_threads: int):
        self.model_dir = model_dir
        self.executor = InprocExecutor(WorkerConfig(model=model_dir, dtype="float32", block_size=BLOCK_SIZE,
                                                    kv_cache_bytes=KV_CACHE_BYTES, num_threads=num_threads))
        self.eos = eos_token_ids(model_dir)
        self.vocab_size = ModelConfig.from_pretrained(model_dir).vocab_size
        self.num_runs = 0

    def core(self, executor=None):
        config = SchedulerConfig(num_blocks=self.executor.num_blocks, block_size=BLOCK_SIZE,
                                 max_model_len=MAX_MODEL_LEN, eos_token_id=self.eos)
        return EngineCore(config, executor or self.executor, vocab_size=self.vocab_size)

    def start(self, prompts: list[list[int]], max_tokens: int) -> InprocRun:
        self.num_runs += 1
        return InprocRun(self, [f"run{self.num_runs}-{i}" for i in range(len(prompts))], prompts, max_tokens)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Run every prompt to max_tokens; returns e2e and decode-phase seconds and the tokens."""
        run = self.start(prompts, max_tokens)
        while not run.is_done:
            run.step()
        return run.result()

    def close(self) -> None:
        self.executor.close()


class InprocRun:
    """One batch of requests on a fresh EngineCore, stepped by the caller, its own time counted
    step by step (so that it can run interleaved with something else)."""

    def __init__(self, engine: InprocEngine, req_ids: list[str], prompts: list[list[int]], max_tokens: int):
        self.engine, self.req_ids = engine, req_ids
        self.core = engine.core()
        self.outputs: dict[str, list[int]] = {r: [] for r in req_ids}
        self.wall_s = self.cpu_s = 0.0
        self.first_all_s: float | None = None
        self.decode_step_s: list[float] = []  # steps after every request had its first token
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        since = clocks()
        for req_id, prompt in zip(req_ids, prompts):
            self.core.add_request(AddRequest(req_id, prompt, sampling))
        self._count(since)

    def _count(self, since: tuple[float, float]) -> float:
        """Add the time since `since` (from clocks()) to this run's; returns the wall seconds."""
        wall, cpu = (now - then for now, then in zip(clocks(), since))
        self.wall_s += wall
        self.cpu_s += cpu
        return wall

    @property
    def is_done(self) -> bool:
        return not self.core.has_work()

    def step(self) -> None:
        since = clocks()
        updates = self.core.step()
        seconds = self._count(since)
        for update in updates:
            self.outputs[update.req_id] += update.new_token_ids
        if self.first_all_s is not None:
            self.decode_step_s.append(seconds)
        elif all(self.outputs.values()):
            self.first_all_s = self.wall_s

    def result(self) -> dict:
        self.engine.executor.execute(SchedulerOutput(0, finished_req_ids=self.req_ids))  # the last step's finishes
        return {"e2e_s": self.wall_s, "decode_s": self.wall_s - self.first_all_s, "first_all_s": self.first_all_s,
                "cpu_s": self.cpu_s, "steps": self.core.num_steps, "decode_step_s": self.decode_step_s,
                "tokens": list(self.outputs.values())}


# transformers


class HfEngine:
    def __init__(self, model_dir: str):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.pad = self.model.config.pad_token_id or 0

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 between_steps: Callable[[], None] | None = None) -> dict:
        """One padded batch (left padding), greedy, exactly max_tokens new tokens per row.

        `between_steps` runs after each of generate's forwards (from a logits processor); its
        time is not counted."""
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        first_call: list[float] = []
        others = {"wall_s": 0.0, "cpu_s": 0.0}

        def hook(input_ids, scores):
            if not first_call:
                first_call.append(time.perf_counter() - others["wall_s"])
            if between_steps is not None:
                since = clocks()
                between_steps()
                wall, cpu = (now - then for now, then in zip(clocks(), since))
                others["wall_s"] += wall
                others["cpu_s"] += cpu
            return scores

        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                      do_sample=False, pad_token_id=self.pad, logits_processor=[hook])
        end = time.perf_counter() - others["wall_s"]
        return {"e2e_s": end - start, "decode_s": end - first_call[0],
                "cpu_s": time.process_time() - cpu_start - others["cpu_s"], "tokens": out[:, width:].tolist()}

    def generate_one_by_one(self, prompts: list[list[int]], max_tokens: int) -> dict:
        runs = [self.generate([p], max_tokens) for p in prompts]
        return {key: sum(r[key] for r in runs) for key in ("e2e_s", "decode_s", "cpu_s")} | {
            "tokens": [r["tokens"][0] for r in runs]}


def side_by_side(ours: InprocEngine, hf: HfEngine, prompts: list[list[int]], max_tokens: int) -> tuple[dict, dict]:
    """Ours and HF on the same prompts, interleaved step by step: one EngineCore step after each
    of generate's forwards, then whatever steps ours still needs."""
    run = ours.start(prompts, max_tokens)
    theirs = hf.generate(prompts, max_tokens, between_steps=lambda: None if run.is_done else run.step())
    while not run.is_done:
        run.step()
    return run.result(), theirs


def tokens_per_s(runs: list[dict], num_requests: int, max_tokens: int) -> dict[str, float]:
    """Generated tokens per second, e2e and decode-phase: the median over runs, and the best
    (the run least disturbed by the machine's other work); and tokens per CPU second."""
    e2e = [num_requests * max_tokens / r["e2e_s"] for r in runs]
    decode = [num_requests * (max_tokens - 1) / r["decode_s"] for r in runs]
    per_cpu = [num_requests * max_tokens / r["cpu_s"] for r in runs]
    return {"e2e": statistics.median(e2e), "decode": statistics.median(decode), "e2e_best": max(e2e),
            "decode_best": max(decode), "per_cpu_s": statistics.median(per_cpu)}


def paired_speedup(ours: list[dict], theirs: list[dict], key: str = "e2e_s") -> float:
    """Median over rounds of theirs' seconds / ours' seconds in the same round: ours' rate over
    theirs, each round compared only with its neighbour in time."""
    return statistics.median(t[key] / o[key] for o, t in zip(ours, theirs))


def rows_agree(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """The share of requests whose generated tokens are the same on both sides."""
    return sum(a == b for a, b in zip(ours, theirs)) / len(ours)


# (a)


def throughput(ours: InprocEngine, hf: HfEngine, args) -> list[dict]:
    n = args.output_tokens
    rounds = args.rounds or (1 if args.quick else 2)
    runs = {c: {"ours": [], "hf_batch": []} for c in args.concurrency}
    sequential = []
    warm = make_prompts(2, seed=999)
    ours.generate(warm, 4)
    hf.generate(warm, 4)
    for r in range(rounds):
        for c in args.concurrency:
            mine, theirs = side_by_side(ours, hf, make_prompts(c, seed=1000 * r + c), n)
            runs[c]["ours"].append(mine)
            runs[c]["hf_batch"].append(theirs)
        sequential.append(hf.generate_one_by_one(make_prompts(args.hf_sequential, seed=7000 + r), n))
    seq = tokens_per_s(sequential, args.hf_sequential, n)
    rows = []
    for c in args.concurrency:
        o = tokens_per_s(runs[c]["ours"], c, n)
        b = tokens_per_s(runs[c]["hf_batch"], c, n)
        agree = statistics.mean(rows_agree(mine["tokens"], theirs["tokens"])
                                for mine, theirs in zip(runs[c]["ours"], runs[c]["hf_batch"]))
        rows.append({"concurrency": c, "output_tokens": n, "rounds": rounds,
                     "ours_e2e_tok_s": o["e2e"], "ours_decode_tok_s": o["decode"],
                     "hf_batch_e2e_tok_s": b["e2e"], "hf_batch_decode_tok_s": b["decode"],
                     "hf_sequential_e2e_tok_s": seq["e2e"], "hf_sequential_decode_tok_s": seq["decode"],
                     "ours_over_hf_batch_e2e": ratio(o["e2e"], b["e2e"]),
                     "ours_over_hf_batch_decode": ratio(o["decode"], b["decode"]),
                     "ours_over_hf_batch_e2e_best": ratio(o["e2e_best"], b["e2e_best"]),
                     "ours_over_hf_batch_e2e_paired": paired_speedup(runs[c]["ours"], runs[c]["hf_batch"]),
                     "ours_over_hf_sequential_e2e": ratio(o["e2e"], seq["e2e"]),
                     "ours_tok_per_cpu_s": o["per_cpu_s"], "hf_batch_tok_per_cpu_s": b["per_cpu_s"],
                     "ours_over_hf_batch_per_cpu_s": ratio(o["per_cpu_s"], b["per_cpu_s"]),
                     "greedy_rows_agree_with_hf_batch": agree,
                     "ours_e2e_s": [x["e2e_s"] for x in runs[c]["ours"]],
                     "hf_batch_e2e_s": [x["e2e_s"] for x in runs[c]["hf_batch"]]})
    print_table(f"(a) generated tokens/s, {n} output tokens per request, greedy, prompts of {PROMPT_LENS[0]}-"
                f"{PROMPT_LENS[1]} tokens (median of {rounds} round(s); HF sequential on {args.hf_sequential} "
                f"requests)",
                ["requests", "ours e2e", "ours decode", "HF batch e2e", "HF batch decode", "HF seq e2e",
                 "ours/HF batch e2e (paired)", "decode", "per CPU s", "ours/HF seq", "rows agree"],
                [[r["concurrency"], r["ours_e2e_tok_s"], r["ours_decode_tok_s"], r["hf_batch_e2e_tok_s"],
                  r["hf_batch_decode_tok_s"], r["hf_sequential_e2e_tok_s"],
                  f"{r['ours_over_hf_batch_e2e']:.2f} ({r['ours_over_hf_batch_e2e_paired']:.2f})",
                  f"{r['ours_over_hf_batch_decode']:.2f}", f"{r['ours_over_hf_batch_per_cpu_s']:.2f}",
                  f"{r['ours_over_hf_sequential_e2e']:.2f}",
                  f"{r['greedy_rows_agree_with_hf_batch']:.0%}"] for r in rows])
    return rows


# (b)


class TimedExecutor:
    """The in-process executor, timing each execute and remembering what it ran."""

    def __init__(self, inner):
        self.inner, self.num_blocks = inner, inner.num_blocks
        self.last_seconds, self.last_output = 0.0, None

    def execute(self, scheduler_output):
        self.last_output = scheduler_output
        self.last_seconds, result = timed(lambda: self.inner.execute(scheduler_output))
        return result

    def submit(self, scheduler_output):
        self.result = self.execute(scheduler_output)

    def wait(self, step_id):
        return self.result

    def close(self) -> None:
        pass


def step_overhead(ours: InprocEngine, args, batch: int = 16) -> dict:
    n = 8 if args.mode == "smoke" else 32 if args.quick else 64
    executor = TimedExecutor(ours.executor)
    core = ours.core(executor)
    sampling = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    req_ids = [f"overhead-{i}" for i in range(batch)]
    for req_id, prompt in zip(req_ids, make_prompts(batch, seed=42)):
        core.add_request(AddRequest(req_id, prompt, sampling))
    steps, executes = [], []
    while core.has_work():
        seconds, _ = timed(core.step)
        out = executor.last_output
        if (not out.new_requests and len(out.num_scheduled_tokens) == batch
                and out.total_num_scheduled_tokens == batch):  # a pure decode step of the whole batch
            steps.append(seconds)
            executes.append(executor.last_seconds)
    ours.executor.execute(SchedulerOutput(0, finished_req_ids=req_ids))
    steps, executes = steps[2:], executes[2:]  # the first decode steps warm up
    result = {"batch": batch, "steps": len(steps), "step_ms": median_ms(steps), "execute_ms": median_ms(executes),
              "ratio_of_sums": sum(steps) / sum(executes),
              "paired_ratio_median": statistics.median(s / e for s, e in zip(steps, executes)),
              "overhead_ms_median": median_ms([s - e for s, e in zip(steps, executes)]),
              "overhead_ms_p90": percentile([s - e for s, e in zip(steps, executes)], 90) * 1e3}
    print_table(f"(b) step overhead, batch {batch}, {len(steps)} decode steps", [
        "EngineCore.step ms", "Worker.execute ms", "step/execute", "overhead ms (p90)", "goal"],
        [[result["step_ms"], result["execute_ms"], f"{result['ratio_of_sums']:.3f}",
          f"{result['overhead_ms_median']:.2f} ({result['overhead_ms_p90']:.2f})", "<= 1.15"]])
    return result


# (c)


def decode_step_bytes(batch: int) -> bytes:
    """A realistic ring message: the SchedulerOutput of one decode step of `batch` requests."""
    req_ids = [uuid.uuid4().hex for _ in range(batch)]
    cached = [CachedRequest(r, 100 + i, [1234 + i], [500 + i] if i % 16 == 0 else []) for i, r in enumerate(req_ids)]
    return ring_encoder.encode(SchedulerOutput(12345, cached_requests=cached,
                                               num_scheduled_tokens=dict.fromkeys(req_ids, 1)))


def ring_round_trip(args, children: Children) -> list[dict]:
    payloads = {"decode step, batch 16": decode_step_bytes(16), "decode step, batch 64": decode_step_bytes(64),
                "1 KiB": os.urandom(1024), "64 KiB": os.urandom(64 << 10)}
    prefix = children.own_shm(f"vsup-bench-{os.getpid()}-ring")
    spawn = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory(prefix="vsup-bench-") as tmp:
        there, back = f"ipc://{tmp}/there.sock", f"ipc://{tmp}/back.sock"
        out = ShmBroadcastWriter.create(prefix, 1, there, slot_bytes=1 << 20, num_slots=8)
        mine, theirs = spawn.Pipe()
        echo = spawn.Process(target=ring_echo, args=(out.name, there, f"{prefix}-back", back, theirs), daemon=True)
        echo.start()
        inbound = None
        try:
            if not mine.poll(60):
                raise RuntimeError(f"the ring echo process did not start (exit code {echo.exitcode})")
            inbound = ShmBroadcastReader.attach(mine.recv(), 0, back)
            out.wait_for_readers(60)
            out.unlink()
            for name, data in payloads.items():
                for _ in range(50):
                    out.enqueue(data)
                    inbound.dequeue()
                trips = []
                for _ in range(args.trips):
                    start = time.perf_counter()
                    out.enqueue(data)
                    inbound.dequeue()
                    trips.append(time.perf_counter() - start)
                us = [t * 1e6 for t in trips]
                rows.append({"payload": name, "bytes": len(data), "trips": args.trips,
                             "median_us": statistics.median(us), "p99_us": percentile(us, 99),
                             "p90_us": percentile(us, 90)})
        finally:
            out.close()  # the echo reads RingClosed and exits
            echo.join(10)
            if echo.is_alive():
                echo.kill()
                echo.join()
            if inbound is not None:
                inbound.close()
    print_table(f"(c) ring round trip (there and back: two ring hops), us, {args.trips} trips each",
                ["payload", "bytes", "median", "p90", "p99", "goal"],
                [[r["payload"], r["bytes"], r["median_us"], r["p90_us"], r["p99_us"], "<= 100"] for r in rows])
    return rows


# (d)


class ProcessDeployment:
    """A real `python -m engine.core` and one `python -m engine.worker`, and a ROUTER as the API server."""

    def __init__(self, model_dir: str, num_threads: int, children: Children, tmp: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"ipc://{tmp}/a0.sock")
        prefix = children.own_shm(f"vsup-bench-{os.getpid()}-core")
        self.logs = {name: open(Path(tmp) / f"{name}.log", "wb") for name in ("core", "worker")}
        env = {**os.environ, "VSUP_LOG_LEVEL": "warning", "OMP_NUM_THREADS": str(num_threads)}
        self.core = children.spawn(
            [sys.executable, "-m", "engine.core", "--model", model_dir,
             "--api-server-address", f"ipc://{tmp}/a0.sock", "--worker-address", f"ipc://{tmp}/workers.sock",
             "--control-address", f"ipc://{tmp}/control.sock", "--ring-prefix", prefix,
             "--wakeup-address", f"ipc://{tmp}/wake.sock", "--block-size", str(BLOCK_SIZE),
             "--max-model-len", str(MAX_MODEL_LEN)],
            cwd=REPO_ROOT, env=env, stdout=self.logs["core"], stderr=self.logs["core"])
        self.worker = children.spawn(
            [sys.executable, "-m", "engine.worker", "--model", model_dir, "--dtype", "float32",
             "--kv-cache-bytes", str(KV_CACHE_BYTES), "--block-size", str(BLOCK_SIZE),
             "--core-address", f"ipc://{tmp}/workers.sock", "--dist-init-method", f"file://{tmp}/dist",
             "--num-threads", str(num_threads)],
            cwd=REPO_ROOT, env=env, stdout=self.logs["worker"], stderr=self.logs["worker"])
        self.tmp = tmp
        self.num_runs = self.num_steps = 0
        self.recv(Ready, timeout_s=300)

    def recv(self, kind, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                _, raw = self.sock.recv_multipart()
                msg = from_core.decode(raw)
                if isinstance(msg, Failed):
                    raise RuntimeError(f"the engine core failed: {msg.error}")
                if isinstance(msg, kind):
                    return msg
            elif self.core.poll() is not None or self.worker.poll() is not None:
                raise RuntimeError(f"the engine core or its worker exited; see {self.tail()}")
        raise TimeoutError(f"no {kind.__name__} within {timeout_s} s; {self.tail()}")

    def tail(self) -> str:
        for f in self.logs.values():
            f.flush()
        return " | ".join(f"{name}: {(Path(self.tmp) / f'{name}.log').read_text()[-800:]}" for name in self.logs)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        self.num_runs += 1
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        req_ids = [f"run{self.num_runs}-{i}" for i in range(len(prompts))]
        outputs: dict[str, list[int]] = {r: [] for r in req_ids}
        finished = set()
        first_all = None
        # encoded beforehand, so the requests reach the core as close together as they can
        messages = [encoder.encode(AddRequest(r, p, sampling)) for r, p in zip(req_ids, prompts)]
        cpu_start = self.cpu_seconds()
        start = time.perf_counter()
        for message in messages:
            self.sock.send_multipart([b"dp0", message])
        periods, last = [], None  # seconds per step between Outputs, once all have a first token
        while len(finished) < len(req_ids):
            batch = self.recv(Outputs, timeout_s=300)
            now = time.perf_counter()
            for update in batch.outputs:
                outputs[update.req_id] += update.new_token_ids
                if update.finish_reason is not None:
                    finished.add(update.req_id)
            if last is not None:
                periods.append((now - last[0]) / max(1, batch.num_steps - last[1]))
            if first_all is None and all(outputs.values()):
                first_all = now
            if first_all is not None:
                last = (now, batch.num_steps)
        end = time.perf_counter()
        cpu_s = self.cpu_seconds() - cpu_start
        num_steps, self.num_steps = batch.num_steps - self.num_steps, batch.num_steps
        return {"e2e_s": end - start, "decode_s": end - first_all, "first_all_s": first_all - start,
                "cpu_s": cpu_s, "steps": num_steps, "decode_step_s": periods, "tokens": list(outputs.values())}

    def cpu_seconds(self) -> float:
        """CPU time so far of the three processes that serve: this one (the API server's part),
        the engine core and the worker."""
        times = [psutil.Process(p.pid).cpu_times() for p in (self.core, self.worker)]
        return time.process_time() + sum(t.user + t.system for t in times)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
        for f in self.logs.values():
            f.close()


def multiprocess(ours: InprocEngine, args, children: Children, concurrency: int = 32) -> dict:
    n = args.output_tokens
    rounds = args.rounds or (1 if args.quick else 4)
    with tempfile.TemporaryDirectory(prefix="vsup-bench-") as tmp:
        start_s, deployment = timed(lambda: ProcessDeployment(ours.model_dir, args.threads, children, tmp))
        try:
            warm = make_prompts(2, seed=999)
            deployment.generate(warm, 4)
            runs = {"multiprocess": [], "in_process": []}
            for r in range(rounds):
                prompts = make_prompts(concurrency, seed=5000 + r)
                order = (("multiprocess", deployment.generate), ("in_process", ours.generate))
                for name, generate in order if r % 2 == 0 else reversed(order):
                    runs[name].append(generate(prompts, n))
            agree = statistics.mean(rows_agree(m["tokens"], i["tokens"])
                                    for m, i in zip(runs["multiprocess"], runs["in_process"]))
        finally:
            deployment.close()
            children.stop()
    m = tokens_per_s(runs["multiprocess"], concurrency, n)
    i = tokens_per_s(runs["in_process"], concurrency, n)
    result = {"concurrency": concurrency, "output_tokens": n, "rounds": rounds, "startup_s": start_s,
              "multiprocess_e2e_tok_s": m["e2e"], "multiprocess_decode_tok_s": m["decode"],
              "in_process_e2e_tok_s": i["e2e"], "in_process_decode_tok_s": i["decode"],
              "ratio_e2e": ratio(m["e2e"], i["e2e"]), "ratio_decode": ratio(m["decode"], i["decode"]),
              "ratio_e2e_best": ratio(m["e2e_best"], i["e2e_best"]),
              "ratio_e2e_paired": paired_speedup(runs["multiprocess"], runs["in_process"]),
              "ratio_decode_paired": paired_speedup(runs["multiprocess"], runs["in_process"], "decode_s"),
              "ratio_decode_best": ratio(m["decode_best"], i["decode_best"]), "greedy_rows_agree": agree,
              "multiprocess_decode_step_ms": median_ms([t for x in runs["multiprocess"] for t in x["decode_step_s"]]),
              "in_process_decode_step_ms": median_ms([t for x in runs["in_process"] for t in x["decode_step_s"]]),
              "multiprocess_tok_per_cpu_s": m["per_cpu_s"], "in_process_tok_per_cpu_s": i["per_cpu_s"],
              "ratio_per_cpu_s": ratio(m["per_cpu_s"], i["per_cpu_s"]),
              "multiprocess_cpu_s": [x["cpu_s"] for x in runs["multiprocess"]],
              "in_process_cpu_s": [x["cpu_s"] for x in runs["in_process"]],
              "multiprocess_e2e_s": [x["e2e_s"] for x in runs["multiprocess"]],
              "in_process_e2e_s": [x["e2e_s"] for x in runs["in_process"]],
              "multiprocess_first_all_s": [x["first_all_s"] for x in runs["multiprocess"]],
              "in_process_first_all_s": [x["first_all_s"] for x in runs["in_process"]],
              "multiprocess_steps": [x["steps"] for x in runs["multiprocess"]],
              "in_process_steps": [x["steps"] for x in runs["in_process"]]}
    print_table(f"(d) {concurrency} concurrent requests, {n} output tokens, tokens/s (median of {rounds} round(s); "
                f"processes started and ready in {start_s:.1f} s)",
                ["", "multiprocess", "in-process", "mp/in", "paired", "best", "goal"],
                [["e2e", m["e2e"], i["e2e"], f"{result['ratio_e2e']:.3f}", f"{result['ratio_e2e_paired']:.3f}",
                  f"{result['ratio_e2e_best']:.3f}", ">= 0.95"],
                 ["decode", m["decode"], i["decode"], f"{result['ratio_decode']:.3f}",
                  f"{result['ratio_decode_paired']:.3f}", f"{result['ratio_decode_best']:.3f}", ">= 0.95"],
                 ["decode step ms (median)", result["multiprocess_decode_step_ms"], result["in_process_decode_step_ms"],
                  f"{ratio(result['in_process_decode_step_ms'], result['multiprocess_decode_step_ms']):.3f}", "", "",
                  ">= 0.95"],
                 ["tokens per CPU s", m["per_cpu_s"], i["per_cpu_s"], f"{result['ratio_per_cpu_s']:.3f}", "", "",
                  ""],
                 ["steps per run", " ".join(map(str, result["multiprocess_steps"])),
                  " ".join(map(str, result["in_process_steps"])), "", "", "", ""]])
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    conditions = setup(args.threads)
    model_dir = str(default_model_dir())
    results: dict = {"conditions": conditions, "args": {k: sorted(v) if isinstance(v, set) else v
                                                        for k, v in vars(args).items()}}
    print(f"engine_core: {args.threads} torch threads (in-process and in the worker process), "
          f"{conditions['cpu_count']} CPUs, load average {conditions['load_average_at_start'][0]:.2f}")
    with Children() as children:
        ours = InprocEngine(model_dir, args.threads)
        try:
            if "c" in args.parts:
                results["ring_round_trip"] = ring_round_trip(args, children)
            if "b" in args.parts:
                results["step_overhead"] = step_overhead(ours, args)
            if "d" in args.parts:
                results["multiprocess"] = multiprocess(ours, args, children, args.mp_concurrency)
            if "a" in args.parts:
                hf = HfEngine(model_dir)
                results["throughput"] = throughput(ours, hf, args)
        finally:
            ours.close()
    write_results("engine_core", results, args.mode)


if __name__ == "__main__":
    main()
