"""Tensor and data parallelism through `vsup serve`, side by side in one run: throughput of 16
concurrent streams against TP = DP = 1.

Every configuration is a real `vsup serve` of the default model (its own run dir and port); all
of them are started together, then each round runs the same 16 streaming completions (greedy,
ignore_eos) through each in turn, the order rotating every round, so the ones not measured sit
idle. The figure that counts is each configuration's tokens/s over TP=1 DP=1's in the same round
(median over rounds).

On the CPU, the workers of a deployment share the machine's cores (vsup gives each worker
cores / workers torch threads), so on 2 cores TP=2 and DP=2 cannot add compute: they show what
the split costs (all-reduces across processes, a second engine core, the coordinator). TP must
divide the model's attention and KV heads: SmolLM2-135M has 9 and 3, so TP=2 is refused (vsup
plan says so) and the bench takes the smallest TP > 1 that divides both (3) instead.

    python bench/scaling.py [--quick | --smoke] [--device cpu|cuda] [--streams 16] [--configs tp1,tp2,dp2]

With `--device cuda` the same run goes to the GPUs (one per worker; configurations that need
more GPUs than there are are skipped); without a CUDA device it exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import (Children, add_mode_args, conditions, mode, print_table, ratio, run_streams, settle,
                    stream_summary, vsup_serve, write_results)

CONFIGS = {"tp1": {"tp": 1, "dp": 1, "pp": 1}, "tp2": {"tp": 2, "dp": 1, "pp": 1}, "dp2": {"tp": 1, "dp": 2, "pp": 1},
           "pp2": {"tp": 1, "dp": 1, "pp": 2}, "tp2dp2": {"tp": 2, "dp": 2, "pp": 1}}


def model_heads(model_dir: Path) -> tuple[int, int]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    return heads, config.get("num_key_value_heads", heads)


def fit_tp(tp: int, heads: int, kv_heads: int) -> int:
    """`tp` if it divides both head counts, else the smallest larger one that does."""
    for t in range(tp, heads + 1):
        if heads % t == 0 and kv_heads % t == 0:
            return t
    return 1


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def serve_args(cfg: dict, device: str, kv_cache: str) -> list[str]:
    return ["-tp", str(cfg["tp"]), "-dp", str(cfg["dp"]), "-pp", str(cfg["pp"]), "--device", device,
            "--max-model-len", "2048", *(["--kv-cache-memory", kv_cache] if device == "cpu" else [])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_args(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--streams", type=int, default=None, help="concurrent streams (default 16; smoke 2)")
    parser.add_argument("--output-tokens", type=int, default=None, help="per stream (smoke 4, quick 32, full 64)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (quick and smoke 1, full 3)")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated, from {','.join(CONFIGS)} (default tp1,tp2,dp2; full adds pp2)")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="per worker, on the CPU")
    args = parser.parse_args(argv)
    run_mode = mode(args)
    gpus = 0
    if args.device == "cuda":
        gpus = cuda_devices()
        if not gpus:
            print("scaling.py: error: --device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                  "run it on a machine with GPUs, or use --device cpu", file=sys.stderr)
            return 2
    smoke = run_mode == "smoke"
    streams = args.streams or (2 if smoke else 16)
    n = args.output_tokens or (4 if smoke else 32 if args.quick else 64)
    rounds = args.rounds or (1 if args.quick else 3)
    names = (args.configs or ("tp1,tp2" if smoke else "tp1,tp2,dp2" if args.quick else "tp1,tp2,dp2,pp2")).split(",")
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or "tp1" not in names:
        parser.error(f"--configs: {', '.join(unknown) or 'tp1 (the baseline) missing'}; choose from {', '.join(CONFIGS)}")

    from engine.model.default_model import default_model_dir

    model_dir = default_model_dir()
    heads, kv_heads = model_heads(model_dir)
    configs, notes = {}, []
    for name in names:
        cfg = dict(CONFIGS[name])
        if cfg["tp"] > 1 and (heads % cfg["tp"] or kv_heads % cfg["tp"]):
            fitted = fit_tp(cfg["tp"], heads, kv_heads)
            notes.append(f"{name}: TP={cfg['tp']} does not divide the model's {heads} attention and {kv_heads} KV heads "
                         f"(vsup refuses it); measured TP={fitted} instead")
            cfg["tp"] = fitted
        workers = cfg["tp"] * cfg["dp"] * cfg["pp"]
        if gpus and workers > gpus:
            notes.append(f"{name}: needs {workers} GPUs, {gpus} here; skipped")
            continue
        cfg["workers"] = workers
        cfg["label"] = f"TP={cfg['tp']} DP={cfg['dp']}" + (f" PP={cfg['pp']}" if cfg["pp"] > 1 else "")
        configs[name] = cfg
    for note in notes:
        print(f"note: {note}", flush=True)

    results: dict = {"conditions": conditions(), "device": args.device, "cpu_count": os.cpu_count(), "gpus": gpus,
                     "streams": streams, "output_tokens": n, "rounds": rounds, "notes": notes,
                     "model_heads": [heads, kv_heads], "configs": configs}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    with Children(grace_s=30) as children, tempfile.TemporaryDirectory(prefix="vsup-bench-scaling-") as tmp:
        servers = {}
        try:
            for name, cfg in configs.items():
                servers[name] = vsup_serve(children, Path(tmp) / name, *serve_args(cfg, args.device,
                                                                                   args.kv_cache_memory))
            for name in list(servers):
                t = time.perf_counter()
                try:
                    configs[name]["ready_s"] = servers[name].wait_ready(timeout_s=600)
                except (RuntimeError, TimeoutError) as e:  # e.g. its free port was taken meanwhile
                    print(f"{configs[name]['label']}: did not start, once more on a fresh port: {e}", flush=True)
                    servers[name].stop()
                    servers[name] = vsup_serve(children, Path(tmp) / f"{name}-again",
                                               *serve_args(configs[name], args.device, args.kv_cache_memory))
                    configs[name]["ready_s"] = servers[name].wait_ready(timeout_s=600)
                server = servers[name]
                asyncio.run(run_streams(server.url, server.model, ["warm-up 1", "warm-up 2"], 4))
                print(f"{configs[name]['label']}: ready (+{time.perf_counter() - t:.1f} s)", flush=True)
            order = list(servers)
            for r in range(rounds):
                prompts = [f"round {r}, stream {i}: Once upon a time, in a city" for i in range(streams)]
                shift = r % len(order)
                for name in order[shift:] + order[:shift]:
                    settle([server.proc for server in servers.values()])
                    run = asyncio.run(run_streams(servers[name].url, servers[name].model, prompts, n))
                    runs[name].append(run)
                print(f"  round {r}: " + ", ".join(f"{configs[k]['label']} {runs[k][-1]['tokens'] / runs[k][-1]['wall_s']:.1f}"
                                                   f" tok/s" for k in order), flush=True)
        finally:
            for server in servers.values():
                server.stop()
    rows = []
    base = [x["tokens"] / x["wall_s"] for x in runs["tp1"]]
    for name, cfg in configs.items():
        rates = [x["tokens"] / x["wall_s"] for x in runs[name]]
        merged = {"wall_s": sum(x["wall_s"] for x in runs[name]), "tokens": sum(x["tokens"] for x in runs[name]),
                  "chunks": sum(x["chunks"] for x in runs[name]),
                  "ttft_s": [t for x in runs[name] for t in x["ttft_s"]], "itl_s": [t for x in runs[name] for t in x["itl_s"]]}
        rows.append({"config": name, **cfg, **stream_summary(merged), "tokens_per_s": statistics.median(rates),
                     "tokens_per_s_rounds": rates,
                     "over_tp1": statistics.median(ratio(a, b) for a, b in zip(rates, base))})
    results["rows"] = rows
    print_table(f"{streams} streams of {n} tokens on {args.device} ({os.cpu_count()} CPUs), tokens/s median of "
                f"{rounds} round(s); ratio = tokens/s over TP=1 DP=1's in the same round",
                ["config", "workers", "ready s", "tokens/s", "ratio", "TTFT p50", "ITL p50", "ITL p99"],
                [[r["label"], r["workers"], r["ready_s"], r["tokens_per_s"], f"{r['over_tp1']:.2f}", r["ttft_p50_ms"],
                  r["itl_p50_ms"], r["itl_p99_ms"]] for r in rows])
    write_results("scaling", results, run_mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
