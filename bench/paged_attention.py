"""The CPU decode attention over the paged KV cache, side by side (issue 20, part 1).

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64), S sequences of L tokens
each, their blocks scattered over the cache as an allocator leaves them. Three sides, alternating,
the order rotating every round:
- `vectorized`: engine/ops/csrc/paged_attention.cpp as a step runs it (with AVX-512 and a head_dim
  of 64 or 128: 16 tokens' dots summed across lanes together, rows prefetched);
- `one dot`: the same kernel with vectorized=False, one dot at a time (what a CPU without AVX-512
  runs; the kernel before the vectorized one, less its division per token);
- `torch`: the plain path the kernel replaces (each sequence's blocks gathered, then SDPA);
- `bf16 KV`: the vectorized kernel over bfloat16 copies of the same caches (--kv-cache-dtype
  bfloat16), which it widens as it loads them: half the bytes read.
Two places for the cache: `resident`, two layers' caches read in turn (they stay in the CPU's
caches), and `streamed`, as many layers as --streamed-mb of K and V (larger than the last-level
cache: read from memory, as a step of a 30-layer model at batch 64 does). A sample is one pass over
the layers; the figure is the median per layer, and GB/s is the K and V bytes read over that time.

    python bench/paged_attention.py --quick     # about a minute on a quiet 2-core machine
    python bench/paged_attention.py             # full: more rounds, contexts 96 and 512
    python bench/paged_attention.py --smoke     # seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import add_mode_args, mode, print_table, rotated, setup, write_results
from engine.model import attention
from engine.model.attention import AttentionMetadata
from engine.ops import cpu_extension

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_args(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seqs", default="16,64", help="comma-separated sequence counts")
    p.add_argument("--contexts", default=None, help="comma-separated tokens per sequence (quick 96, full 96,512)")
    p.add_argument("--rounds", type=int, default=None, help="quick 5, full 15")
    p.add_argument("--streamed-mb", type=int, default=1024, help="K and V bytes of the streamed case, in MB")
    args = p.parse_args(argv)
    args.mode = mode(args)
    if args.mode == "smoke":
        args.seqs, args.contexts, args.rounds, args.streamed_mb = "4", "40", 1, 8
    args.contexts = args.contexts or ("96" if args.mode == "quick" else "96,512")
    args.rounds = args.rounds or (5 if args.mode == "quick" else 15)
    args.seqs = [int(x) for x in args.seqs.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    return args


def kv_bytes(seqs: int, context: int) -> int:
    """The K and V bytes one layer reads."""
    return 2 * seqs * context * KV_HEADS * HEAD_DIM * 4


class Layers:
    """`count` layers' K and V caches for `seqs` sequences of `context` tokens, the blocks shuffled."""

    def __init__(self, seqs: int, context: int, count: int, gen: torch.Generator):
        per_seq = -(-context // BLOCK_SIZE)
        num_blocks = 1 + seqs * per_seq
        self.caches = [(torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen),
                        torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)) for _ in range(count)]
        self.bf16_caches = [(k.bfloat16(), v.bfloat16()) for k, v in self.caches]
        tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(seqs, per_seq).tolist()
        self.metadata = AttentionMetadata.build([context - 1] * seqs, [1] * seqs, tables, BLOCK_SIZE)
        self.query = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen)
        self.out = torch.empty(self.query.shape)
        self.bytes = kv_bytes(seqs, context)

    def kernel(self, vectorized: bool, bf16: bool = False) -> None:
        m = self.metadata
        for k, v in self.bf16_caches if bf16 else self.caches:
            torch.ops.vsup_cpu.paged_attention_decode(self.query, k, v, m.block_tables, m.seq_lens, HEAD_DIM ** -0.5,
                                                      self.out, vectorized)

    def torch_path(self) -> None:
        m = self.metadata
        for k, v in self.caches:
            attention._decode_attention_torch(self.query, k, v, m.block_tables, m.seq_lens, m.max_seq_len,
                                              HEAD_DIM ** -0.5, m)


def measure(layers: Layers, rounds: int) -> dict[str, float]:
    """Median seconds per layer of each side."""
    sides = {"vectorized": lambda: layers.kernel(True), "one dot": lambda: layers.kernel(False),
             "torch": layers.torch_path, "bf16 KV": lambda: layers.kernel(True, bf16=True)}
    for run in sides.values():  # warm up (and page the caches in)
        run()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in rotated(list(sides), r):
            start = time.perf_counter()
            sides[name]()
            times[name].append((time.perf_counter() - start) / len(layers.caches))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not cpu_extension.load():
        raise SystemExit("the CPU kernels could not be built (engine/ops/cpu_extension.py)")
    results = {"conditions": setup(args.threads), "args": vars(args), "rows": []}
    gen = torch.Generator().manual_seed(0)
    for context in args.contexts:
        for seqs in args.seqs:
            streamed = max(2, -(-args.streamed_mb * 2**20 // kv_bytes(seqs, context)))
            for place, count in (("resident", 2), ("streamed", streamed)):
                layers = Layers(seqs, context, count, gen)
                seconds = measure(layers, args.rounds)
                results["rows"].append({"context": context, "seqs": seqs, "place": place, "layers": count,
                                        "ms_per_layer": {n: s * 1e3 for n, s in seconds.items()},
                                        "gb_per_s": {n: layers.bytes / (2 if n == "bf16 KV" else 1) / s / 1e9
                                                     for n, s in seconds.items()}})
                del layers
    print_table("decode attention, ms per layer (median of rounds; GB/s of K and V read)",
                ["context", "seqs", "cache", "vectorized", "one dot", "torch", "bf16 KV", "one dot / vect.",
                 "torch / vect.", "vect. / bf16 KV"],
                [[r["context"], r["seqs"], f"{r['place']} ({r['layers']} layers)",
                  *(f"{r['ms_per_layer'][n]:.3f} ({r['gb_per_s'][n]:.1f})"
                    for n in ("vectorized", "one dot", "torch", "bf16 KV")),
                  f"{r['ms_per_layer']['one dot'] / r['ms_per_layer']['vectorized']:.2f}",
                  f"{r['ms_per_layer']['torch'] / r['ms_per_layer']['vectorized']:.2f}",
                  f"{r['ms_per_layer']['vectorized'] / r['ms_per_layer']['bf16 KV']:.2f}"] for r in results["rows"]])
    write_results("paged_attention", results, args.mode)


if __name__ == "__main__":
    main()
