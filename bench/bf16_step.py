"""The whole engine in bfloat16 against float32 on the CPU: prefill and decode steps (issue 20, part 3).

Three in-process EngineCores on the default model, each on its own Worker, stepped in turn (the
order rotating) on the same requests:

- `f32 packed`: float32, linears from oneDNN-packed weights (what the engine runs);
- `bf16`: bfloat16 with linears through F.linear (what the engine runs where the CPU lacks
  avx512_bf16);
- `bf16 packed`: bfloat16 with every linear and the LM head packed for oneDNN's bf16 brgemm
  (what the engine runs where the CPU has avx512_bf16 or AMX; this bench packs them anywhere);
- `bf16 linears`: float32 (norms, attention, KV cache) with the linears and the LM head packed in
  bfloat16, their rows cast around each (`--linear-dtype bfloat16`).

Prefill: N prompts of L random tokens, one output token each, tokens/s. Decode: B requests of 64
prompt tokens, the step time of `EngineCore.step()` once all have their first token, and the
share of requests whose greedy tokens equal float32's (bfloat16 rounds differently, so some
rows part ways after a few tokens: that is the price, not a bug).

    python bench/bf16_step.py --quick     # 16x128 prefill, 3 rounds; batches 1,16,64, 8 steps
    python bench/bf16_step.py             # 5 rounds, 24 steps
    python bench/bf16_step.py --smoke     # seconds: 2x16 prefill, batch 2, one step
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from common import add_mode_args, median_ms, mode, print_table, rotated, setup, write_results
from engine.core.engine_core import EngineCore
from engine.core.scheduler_config import SchedulerConfig
from engine.executor.executor import InprocExecutor
from engine.model.config import ModelConfig
from engine.model.default_model import default_model_dir
from engine.ops import cpu_linear
from engine.wire.protocol import AddRequest
from engine.wire.sampling_params import SamplingParams
from engine.worker.worker import WorkerConfig

BLOCK_SIZE = 16
SIDES = {"f32 packed": ("float32", False, None), "bf16": ("bfloat16", False, None),
         "bf16 packed": ("bfloat16", True, None), "bf16 linears": ("float32", True, "bfloat16")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_args(p)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--prefill", default="16x128", help="NxL: N prompts of L tokens")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes")
    p.add_argument("--rounds", type=int, default=None, help="prefill runs per side (quick 3, full 5)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (quick 8, full 24)")
    args = p.parse_args(argv)
    args.mode = mode(args)
    if args.mode == "smoke":
        args.prefill, args.batches, args.rounds, args.steps = "2x16", "2", 1, 1
    args.prefill = tuple(int(v) for v in args.prefill.split("x"))
    args.batches = [int(b) for b in args.batches.split(",")]
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.steps = args.steps or (8 if args.quick else 24)
    return args


def load(model_dir: str, dtype: str, packed: bool, linear_dtype: str | None, num_threads: int) -> InprocExecutor:
    enabled = cpu_linear.enabled
    if packed:  # pack whatever the dtype and the CPU
        cpu_linear.enabled = lambda weight, dtype=None: weight.device.type == "cpu"
    else:  # pack float32 only
        cpu_linear.enabled = lambda weight, dtype=None: weight.dtype == torch.float32 and enabled(weight)
    try:
        return InprocExecutor(WorkerConfig(model=model_dir, dtype=dtype, linear_dtype=linear_dtype,
                                           block_size=BLOCK_SIZE, kv_cache_bytes=2**28, num_threads=num_threads))
    finally:
        cpu_linear.enabled = enabled


class Side:
    """One executor; each run gets a fresh EngineCore (no prefix cache across runs)."""

    def __init__(self, executor: InprocExecutor, vocab_size: int):
        self.executor, self.vocab_size = executor, vocab_size

    def core(self) -> EngineCore:
        config = SchedulerConfig(num_blocks=self.executor.num_blocks, block_size=BLOCK_SIZE, max_model_len=2048,
                                 enable_prefix_caching=False)
        return EngineCore(config, self.executor, vocab_size=self.vocab_size)


def prompts(rng: random.Random, n: int, length: int, vocab_size: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab_size - 100) for _ in range(length)] for _ in range(n)]


def compare_prefill(sides: dict[str, Side], n: int, length: int, rounds: int, vocab_size: int) -> dict:
    rng, spent = random.Random(0), {name: [] for name in sides}
    names = list(sides)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(rounds + 1):  # round 0 warms up
        batch = prompts(rng, n, length, vocab_size)
        for name in rotated(names, i):
            core = sides[name].core()
            start = time.perf_counter()
            for j, p in enumerate(batch):
                core.add_request(AddRequest(f"p{i}-{j}", p, one))
            while core.has_work():
                core.step()
            if i:
                spent[name].append(time.perf_counter() - start)
    return {"prompts": n, "prompt_len": length, "seconds": spent,
            "tokens_per_s": {name: n * length / statistics.median(s) for name, s in spent.items()}}


def compare_decode(sides: dict[str, Side], batch: int, steps: int, vocab_size: int) -> dict:
    warmup = 2
    sampling = SamplingParams(temperature=0.0, max_tokens=1 + warmup + steps, ignore_eos=True)
    batch_prompts = prompts(random.Random(batch), batch, 64, vocab_size)
    names = list(sides)
    cores, tokens = {}, {name: {} for name in names}
    for name in names:
        cores[name] = sides[name].core()
        for j, p in enumerate(batch_prompts):
            cores[name].add_request(AddRequest(f"d{batch}-{j}", p, sampling))
    spent = {name: [] for name in names}
    for i in range(1 + warmup + steps):  # step 0 is the prefill
        for name in rotated(names, i):
            start = time.perf_counter()
            updates = cores[name].step()
            if i > warmup:
                spent[name].append(time.perf_counter() - start)
            for u in updates:
                tokens[name].setdefault(u.req_id, []).extend(u.new_token_ids)
    agree = {name: sum(tokens[name][r] == tokens["f32 packed"][r] for r in tokens[name]) / batch for name in names}
    return {"batch": batch, "steps": steps, "seconds": spent, "ms": {n: median_ms(s) for n, s in spent.items()},
            "rows_agree_with_f32": agree}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    conditions = setup(args.threads)
    results: dict = {"conditions": conditions, "args": vars(args)}
    print(f"bf16_step: {args.threads} torch threads, load average {conditions['load_average_at_start'][0]:.2f}")
    model_dir = str(default_model_dir())
    vocab_size = ModelConfig.from_pretrained(model_dir).vocab_size
    sides = {name: Side(load(model_dir, dtype, packed, linear_dtype, args.threads), vocab_size)
             for name, (dtype, packed, linear_dtype) in SIDES.items()}
    pre = results["prefill"] = compare_prefill(sides, *args.prefill, args.rounds, vocab_size)
    base = pre["tokens_per_s"]["f32 packed"]
    print_table(f"prefill of {args.prefill[0]} x {args.prefill[1]} tokens, tokens/s (median of {args.rounds})",
                ["side", "tokens/s", "over f32 packed"],
                [[name, v, f"{v / base:.2f}"] for name, v in pre["tokens_per_s"].items()])
    results["decode"] = [compare_decode(sides, b, args.steps, vocab_size) for b in args.batches]
    print_table(f"decode step, ms (median of {args.steps} steps, EngineCore.step)",
                ["batch", *SIDES, *(f"{n}/f32" for n in list(SIDES)[1:]),
                 *(f"{n} rows = f32" for n in list(SIDES)[1:])],
                [[r["batch"], *r["ms"].values(),
                  *(f"{r['ms'][n] / r['ms']['f32 packed']:.2f}" for n in list(SIDES)[1:]),
                  *(f"{r['rows_agree_with_f32'][n]:.0%}" for n in list(SIDES)[1:])] for r in results["decode"]])
    for side in sides.values():
        side.executor.close()
    write_results("bf16_step", results, args.mode)


if __name__ == "__main__":
    main()
