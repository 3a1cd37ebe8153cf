"""GEMM GFLOP/s of the default model's linear shapes, per way of running them (issue 20, parts 2 and 3).

SmolLM2-135M's linears as the engine runs them: qkv [960 x 576] and gate_up [3072 x 576] fused,
o [576 x 576], down [576 x 1536], and the LM head [49152 x 576]. Each (shape, rows) pair runs
every variant in one process, alternating, the order rotating every round; a sample is a burst of
calls of about 10 ms, and the figure is the median over the rounds (`--stat best`: the fastest
round, the better estimate of what a kernel can do when other work keeps taking the cores).

- float32 (part 2, prefill rows): `F.linear` (MKL, the dense weight), `packed` (what the engine
  does: oneDNN with the weight reordered once, batch hint 16), `packed@rows` (the same with the
  hint set to the rows of the call: a second packing for the prefill shape), and `mm 1024^3`, a
  square float32 GEMM, for what the cores reach on a shape that is not skinny.
- bfloat16 (part 3, decode and prefill rows): float32 `packed` against bfloat16 `F.linear` and
  bfloat16 `packed` (oneDNN's brgemm with avx512_bf16, the weight reordered once).
- stack (part 3): every linear of the model (30 layers of qkv, o, gate_up, down, then the LM head),
  each with its own weights, back to back on the same rows, float32 packed against bfloat16
  packed: the GEMM floor of a whole step in each dtype, weights streamed from memory as in a step.

    python bench/gemm_shapes.py --quick     # about 2 minutes on a quiet 2-core machine
    python bench/gemm_shapes.py             # full: more rounds
    python bench/gemm_shapes.py --smoke     # seconds: one shape, one round
    options: --threads N --rows 64,...,2048 --bf16-rows 1,16,64,512 --rounds N --parts f32,bf16,stack
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common import add_mode_args, mode, print_table, rotated, setup, write_results

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
NUM_LAYERS = 30
SAMPLE_S = 0.01  # one sample: a burst of calls of about this long
STATS = {"median": statistics.median, "best": min}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_args(p)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--rows", default="64,128,256,512,1024,2048", help="float32 rows (prefill chunk sizes)")
    p.add_argument("--bf16-rows", default="1,16,64,512", help="rows of the bfloat16 comparison")
    p.add_argument("--rounds", type=int, default=None, help="samples per variant (quick 7, full 21)")
    p.add_argument("--parts", default="f32,bf16,stack", help="which comparisons to run")
    p.add_argument("--stat", choices=STATS, default="median", help="the figure of a variant's rounds (default median)")
    args = p.parse_args(argv)
    args.mode = mode(args)
    if args.mode == "smoke":
        args.rows, args.bf16_rows, args.rounds = "64", "16", args.rounds or 1
    args.rows = [int(r) for r in args.rows.split(",")]
    args.bf16_rows = [int(r) for r in args.bf16_rows.split(",")]
    args.rounds = args.rounds or (7 if args.quick else 21)
    args.parts = set(args.parts.split(","))
    return args


def packed_linear(weight: torch.Tensor, batch_hint: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x W^T through oneDNN with W reordered once (engine/ops/cpu_linear.py, any hint)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def dense_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.linear(x, weight)


def calls_per_sample(fn: Callable[[], object]) -> int:
    fn()  # primitive creation, first touch
    start = time.perf_counter()
    fn()
    return max(1, min(1000, round(SAMPLE_S / max(time.perf_counter() - start, 1e-6))))


def side_by_side(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each case: `rounds` bursts each, the cases alternating and their order
    rotating every round."""
    names = list(cases)
    counts = {name: calls_per_sample(cases[name]) for name in names}
    spent: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in rotated(names, i):
            fn, n = cases[name], counts[name]
            start = time.perf_counter()
            for _ in range(n):
                fn()
            spent[name].append((time.perf_counter() - start) / n)
    return spent


def gflops(flop: float, seconds: list[float], stat: str = "median") -> float:
    return flop / STATS[stat](seconds) / 1e9


@torch.inference_mode()
def compare_shapes(variants: dict[str, Callable], dtypes: dict[str, torch.dtype], rows_list: list[int],
                   shapes: dict[str, tuple[int, int]], rounds: int, stat: str) -> list[dict]:
    """One row per (shape, rows): GFLOP/s of each variant. `variants[name](weight, rows)` builds the
    call for a weight in `dtypes[name]`."""
    out = []
    for rows in rows_list:
        for shape_name, (out_size, in_size) in shapes.items():
            weight = torch.randn(out_size, in_size) / in_size ** 0.5
            x = torch.randn(rows, in_size)
            cases = {}
            for name, make in variants.items():
                fn, xi = make(weight.to(dtypes[name]), rows), x.to(dtypes[name])
                cases[name] = lambda fn=fn, xi=xi: fn(xi)
            spent = side_by_side(cases, rounds)
            flop = 2 * rows * out_size * in_size
            out.append({"shape": shape_name, "out": out_size, "in": in_size, "rows": rows, "seconds": spent,
                        "gflops": {name: gflops(flop, s, stat) for name, s in spent.items()}})
    return out


@torch.inference_mode()
def compare_square(rounds: int, stat: str, n: int = 1024) -> dict:
    a, b = torch.randn(n, n), torch.randn(n, n)
    spent = side_by_side({"mm": lambda: torch.mm(a, b)}, rounds)
    return {"n": n, "seconds": spent["mm"], "gflops": gflops(2 * n ** 3, spent["mm"], stat)}


@torch.inference_mode()
def compare_stack(rows_list: list[int], rounds: int, stat: str, num_layers: int = NUM_LAYERS) -> list[dict]:
    """The model's every linear, own weights, back to back: float32 packed vs bfloat16 packed."""
    shapes = [SHAPES[s] for s in ("qkv", "o", "gate_up", "down")] * num_layers + [SHAPES["lm_head"]]
    flop_per_row = sum(2 * o * i for o, i in shapes)
    stacks = {}
    for name, dtype in (("f32 packed", torch.float32), ("bf16 packed", torch.bfloat16)):
        stacks[name] = [(packed_linear((torch.randn(o, i) / i ** 0.5).to(dtype), 16), i, dtype) for o, i in shapes]
    out = []
    for rows in rows_list:
        inputs = {(i, dtype): torch.randn(rows, i).to(dtype)
                  for _, i, dtype in stacks["f32 packed"] + stacks["bf16 packed"]}

        def run(stack):
            for fn, i, dtype in stack:
                fn(inputs[(i, dtype)])

        spent = side_by_side({name: lambda s=s: run(s) for name, s in stacks.items()}, rounds)
        out.append({"rows": rows, "seconds": spent, "ms": {n: STATS[stat](s) * 1e3 for n, s in spent.items()},
                    "gflops": {n: gflops(flop_per_row * rows, s, stat) for n, s in spent.items()}})
    return out


def print_shapes(title: str, rows: list[dict], base: str) -> None:
    names = list(rows[0]["gflops"])
    others = [n for n in names if n != base]
    print_table(title, ["shape", "rows", *names, *(f"{n}/{base}" for n in others)],
                [[r["shape"], r["rows"], *(r["gflops"][n] for n in names),
                  *(f"{r['gflops'][n] / r['gflops'][base]:.2f}" for n in others)] for r in rows])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    conditions = setup(args.threads)
    results: dict = {"conditions": conditions, "args": vars(args) | {"parts": sorted(args.parts)}}
    print(f"gemm_shapes: {args.threads} torch threads, load average {conditions['load_average_at_start'][0]:.2f}")
    of = f"{args.stat} of {args.rounds} rounds"
    shapes = {k: v for k, v in SHAPES.items() if k != "lm_head"}  # prefill runs the LM head on last rows only
    if args.mode == "smoke":
        shapes = {"qkv": SHAPES["qkv"]}
    if "f32" in args.parts:
        f32 = {"F.linear": lambda w, rows: dense_linear(w), "packed": lambda w, rows: packed_linear(w, 16),
               "packed@rows": lambda w, rows: packed_linear(w, rows)}
        results["f32"] = compare_shapes(f32, dict.fromkeys(f32, torch.float32), args.rows, shapes, args.rounds,
                                        args.stat)
        results["square"] = compare_square(args.rounds, args.stat)
        print_shapes(f"float32 GFLOP/s ({of}; a square 1024^3 mm: "
                     f"{results['square']['gflops']:.0f})", results["f32"], "packed")
    if "bf16" in args.parts:
        bf16 = {"f32 packed": lambda w, rows: packed_linear(w, 16), "bf16 F.linear": lambda w, rows: dense_linear(w),
                "bf16 packed": lambda w, rows: packed_linear(w, 16)}
        dtypes = {"f32 packed": torch.float32, "bf16 F.linear": torch.bfloat16, "bf16 packed": torch.bfloat16}
        results["bf16"] = compare_shapes(bf16, dtypes, args.bf16_rows, shapes if args.mode == "smoke" else SHAPES,
                                         args.rounds, args.stat)
        print_shapes(f"bfloat16 against float32, GFLOP/s ({of}; one weight, hot in cache)",
                     results["bf16"], "f32 packed")
    if "stack" in args.parts:
        results["stack"] = compare_stack(args.bf16_rows, args.rounds, args.stat,
                                         2 if args.mode == "smoke" else NUM_LAYERS)
        print_table(f"every linear of the model, back to back ({of})",
                    ["rows", "f32 ms", "bf16 ms", "f32 GFLOP/s", "bf16 GFLOP/s", "bf16/f32 time"],
                    [[r["rows"], r["ms"]["f32 packed"], r["ms"]["bf16 packed"], r["gflops"]["f32 packed"],
                      r["gflops"]["bf16 packed"], f"{r['ms']['bf16 packed'] / r['ms']['f32 packed']:.2f}"]
                     for r in results["stack"]])
    write_results("gemm_shapes", results, args.mode)


if __name__ == "__main__":
    main()
