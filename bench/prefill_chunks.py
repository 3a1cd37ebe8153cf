"""Prefill tokens/s of the engine at several chunk sizes, against its own GEMM floor (issue 20, part 2).

The scheduler fills a step with at most `max_num_batched_tokens` prompt tokens (the server's
`--max-num-batched-tokens`, 2048 by default), splitting prompts across steps where they do not
fit. This bench runs a whole prefill (N prompts of L random tokens, one output token each, prefix
caching off) through an in-process EngineCore at each chunk size, the chunk sizes alternating
and their order rotating every round, on one Worker loaded once.

Next to each run, in turn with it, the floor: the same worker's packed linear layers (30 layers
of qkv, o, gate_up, down) on random rows, step by step with the rows the run's steps had, plus
the LM head on the rows that sampled. *GEMM share* is floor / prefill, *GEMM GFLOP/s* the
linears' float32 work over the floor's time.

    python bench/prefill_chunks.py --quick     # 16 prompts of 128 tokens, 3 rounds (about 1 minute)
    python bench/prefill_chunks.py             # also 4 prompts of 1024 tokens, 5 rounds
    python bench/prefill_chunks.py --smoke     # seconds: 2 prompts of 32 tokens, one round
    options: --threads N --chunks 256,512,1024,2048,4096 --workloads 16x128,4x1024 --rounds N
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from common import add_mode_args, mode, print_table, rotated, setup, write_results
from engine.core.engine_core import EngineCore
from engine.core.scheduler_config import SchedulerConfig
from engine.executor.executor import InprocExecutor
from engine.model.config import ModelConfig
from engine.model.default_model import default_model_dir
from engine.wire.protocol import AddRequest
from engine.wire.sampling_params import SamplingParams
from engine.worker.worker import WorkerConfig

BLOCK_SIZE = 16
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_args(p)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--chunks", default="256,512,1024,2048,4096", help="max_num_batched_tokens values")
    p.add_argument("--workloads", default=None, help="NxL: N prompts of L tokens (quick 16x128; full also 4x1024)")
    p.add_argument("--rounds", type=int, default=None, help="runs per chunk size (quick 3, full 5)")
    args = p.parse_args(argv)
    args.mode = mode(args)
    if args.mode == "smoke":
        args.chunks, args.workloads, args.rounds = "32,64", args.workloads or "2x32", args.rounds or 1
    args.chunks = [int(c) for c in args.chunks.split(",")]
    args.workloads = [tuple(int(v) for v in w.split("x")) for w in
                      (args.workloads or ("16x128" if args.quick else "16x128,4x1024")).split(",")]
    args.rounds = args.rounds or (3 if args.quick else 5)
    return args


class CountingExecutor(InprocExecutor):
    """The in-process executor, noting each step's rows (tokens) and sampled rows."""

    def __init__(self, config: WorkerConfig):
        super().__init__(config)
        self.steps: list[tuple[int, int]] = []

    def execute(self, scheduler_output):
        out = super().execute(scheduler_output)
        self.steps.append((sum(scheduler_output.num_scheduled_tokens.values()), len(out.sampled_token_ids)))
        return out


class Floor:
    """The worker's packed linears alone on random rows, for a given list of steps."""

    def __init__(self, executor: InprocExecutor):
        model = executor.worker.runner.model
        self.linears = []
        for layer in model.model.layers.values():
            attn, mlp = layer.self_attn, layer.mlp
            self.linears += [(attn.qkv_proj, attn.qkv_proj.input_size, sum(attn.qkv_proj.shard_sizes)),
                             (attn.o_proj, attn.o_proj.shard_size, attn.o_proj.output_size),
                             (mlp.gate_up_proj, mlp.gate_up_proj.input_size, sum(mlp.gate_up_proj.shard_sizes)),
                             (mlp.down_proj, mlp.down_proj.shard_size, mlp.down_proj.output_size)]
        self.lm_head = model.lm_head
        self.flop_per_row = sum(2 * i * o for _, i, o in self.linears)
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}

    def _input(self, rows: int, width: int) -> torch.Tensor:
        if (rows, width) not in self.inputs:
            self.inputs[(rows, width)] = torch.randn(rows, width)
        return self.inputs[(rows, width)]

    @torch.inference_mode()
    def run(self, steps: list[tuple[int, int]]) -> float:
        start = time.perf_counter()
        for rows, sampled in steps:
            for linear, width, _ in self.linears:
                linear(self._input(rows, width))
            if sampled:
                self.lm_head.logits(self._input(sampled, self.lm_head.hidden_size))
        return time.perf_counter() - start


def prefill(executor: CountingExecutor, vocab_size: int, chunk: int, prompts: list[list[int]], run: int) -> float:
    """Seconds from adding the prompts to every request's one token; the steps go to executor.steps."""
    config = SchedulerConfig(num_blocks=executor.num_blocks, block_size=BLOCK_SIZE, max_model_len=4096,
                             max_num_batched_tokens=chunk, enable_prefix_caching=False)
    core = EngineCore(config, executor, vocab_size=vocab_size)
    executor.steps = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(AddRequest(f"r{run}-{i}", prompt, ONE_TOKEN))
    while core.has_work():
        core.step()
    return time.perf_counter() - start


def compare_chunks(executor: CountingExecutor, vocab_size: int, chunks: list[int], num_prompts: int,
                   prompt_len: int, rounds: int) -> list[dict]:
    floor, rng = Floor(executor), random.Random(0)
    spent = {c: {"prefill_s": [], "floor_s": [], "steps": None} for c in chunks}
    for i in range(rounds + 1):  # round 0 warms every chunk size up
        for chunk in rotated(chunks, i):
            prompts = [[rng.randrange(100, vocab_size - 100) for _ in range(prompt_len)] for _ in range(num_prompts)]
            seconds = prefill(executor, vocab_size, chunk, prompts, i * 1000 + chunk)
            steps = executor.steps
            floor_s = floor.run(steps)
            if i:
                spent[chunk]["prefill_s"].append(seconds)
                spent[chunk]["floor_s"].append(floor_s)
                spent[chunk]["steps"] = steps
    tokens = num_prompts * prompt_len
    rows = []
    for chunk, s in spent.items():
        prefill_s, floor_s = statistics.median(s["prefill_s"]), statistics.median(s["floor_s"])
        rows.append({"workload": f"{num_prompts}x{prompt_len}", "chunk": chunk, "num_steps": len(s["steps"]), **s,
                     "tokens_per_s": tokens / prefill_s, "gemm_share": floor_s / prefill_s,
                     "gemm_gflops": floor.flop_per_row * tokens / floor_s / 1e9})
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    conditions = setup(args.threads)
    results: dict = {"conditions": conditions, "args": vars(args)}
    print(f"prefill_chunks: {args.threads} torch threads, load average {conditions['load_average_at_start'][0]:.2f}")
    model_dir = str(default_model_dir())
    executor = CountingExecutor(WorkerConfig(model=model_dir, dtype="float32", block_size=BLOCK_SIZE,
                                             kv_cache_bytes=2**30, num_threads=args.threads))
    vocab_size = ModelConfig.from_pretrained(model_dir).vocab_size
    results["rows"] = []
    for num_prompts, prompt_len in args.workloads:
        rows = compare_chunks(executor, vocab_size, args.chunks, num_prompts, prompt_len, args.rounds)
        results["rows"] += rows
        base = next((r for r in rows if r["chunk"] == 2048), rows[0])
        print_table(f"prefill of {num_prompts} prompts x {prompt_len} tokens, float32 (median of {args.rounds})",
                    ["chunk", "steps", "tokens/s", f"over chunk {base['chunk']}", "GEMM share", "GEMM GFLOP/s"],
                    [[r["chunk"], r["num_steps"], r["tokens_per_s"], f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}",
                      f"{r['gemm_share']:.0%}", r["gemm_gflops"]] for r in rows])
    executor.close()
    write_results("prefill_chunks", results, args.mode)


if __name__ == "__main__":
    main()
