"""Structured outputs (issue 21): what a JSON schema on half of the requests costs the throughput of
16 streams, against none, in one run; and how long a 50-field schema takes to compile.

(a) One `vsup serve` of the default model (SmolLM2-135M-Instruct, float32, CPU). Each round runs
    16 concurrent streaming completions of the same number of tokens (greedy, ignore_eos) twice,
    the order flipping every round: 0% structured, and 50% under a JSON schema (an array of at
    least 10,000 strings, so that it never ends before max_tokens: both sides generate the same
    tokens' worth). The figure: tokens/s of the 50% side over the 0% side (median over rounds;
    goal >= 0.9). Each side's schema has its own name, so its compile is warm before timing starts.
(b) In this process, the engine core's compiler (engine/structured/compiler.py) on the model's
    tokenizer (49,152 tokens): a 50-field object schema (strings, integers, booleans, enums, in
    turn), compiled afresh each time under a new field prefix (median), and the one-off setup
    (tokenizer and xgrammar's tokenizer info) before the first compile.

    python bench/structured.py [--quick | --smoke]   # quick: 1 round of 32 tokens; full: 3 rounds of 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import Children, add_mode_args, conditions, mode, print_table, ratio, settle, vsup_serve, write_results

NEVER_ENDING = {"type": "array", "items": {"type": "string"}, "minItems": 10000}


def fifty_fields(prefix: str) -> dict:
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"enum": ["a", "b", "c"]}]
    names = [f"{prefix}{i}" for i in range(50)]
    return {"type": "object", "properties": {n: kinds[i % 4] for i, n in enumerate(names)}, "required": names}


async def one(client, model: str, prompt: str, max_tokens: int, schema: dict | None) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


async def run_side(url: str, model: str, streams: int, max_tokens: int, share: float, tag: str) -> dict:
    import httpx

    schema = {**NEVER_ENDING, "description": tag}
    structured = set(range(0, streams, round(1 / share))) if share else set()
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, model, f"Write item {i} of a list:", max_tokens,
                                            schema if i in structured else None) for i in range(streams)))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": sum(tokens), "tokens_per_s": sum(tokens) / wall,
            "num_structured": len(structured)}


def compile_times(model_dir: Path, rounds: int) -> dict:
    from engine.model.config import ModelConfig, eos_token_ids
    from engine.structured.compiler import GrammarCompiler
    from engine.wire.structured_outputs import StructuredOutputs

    config = ModelConfig.from_pretrained(model_dir)
    compiler = GrammarCompiler(str(model_dir), config.vocab_size, eos_token_ids(str(model_dir)) or [], timeout_s=600)
    t = time.perf_counter()
    compiler._xgrammar_compiler()  # the one-off setup, apart
    setup = time.perf_counter() - t
    seconds = []
    for r in range(rounds):
        spec = StructuredOutputs(json=json.dumps(fifty_fields(f"field_{r}_")))
        t = time.perf_counter()
        compiler.compile(spec).future.result()
        seconds.append(time.perf_counter() - t)
    compiler.close()
    return {"setup_s": setup, "compile_s": seconds, "compile_median_ms": statistics.median(seconds) * 1e3,
            "schema_bytes": len(json.dumps(fifty_fields("field_0_")))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_args(parser)
    parser.add_argument("--streams", type=int, default=None, help="concurrent streams (default 16; smoke 2)")
    args = parser.parse_args(argv)
    run_mode = mode(args)
    smoke = run_mode == "smoke"
    streams = args.streams or (2 if smoke else 16)
    n = 4 if smoke else 32 if args.quick else 64
    rounds = 1 if args.quick or smoke else 3

    from engine.model.default_model import default_model_dir

    model_dir = default_model_dir()
    results: dict = {"conditions": conditions(), "streams": streams, "output_tokens": n, "rounds": rounds}
    results["compile"] = compile_times(model_dir, 2 if smoke else 5)
    sides: dict[str, list[dict]] = {"0%": [], "50%": []}
    with Children(grace_s=30) as children, tempfile.TemporaryDirectory(prefix="vsup-bench-structured-") as tmp:
        server = vsup_serve(children, tmp, "--kv-cache-memory", "256MiB", "--max-model-len", "2048")
        server.wait_ready(timeout_s=600)
        asyncio.run(run_side(server.url, server.model, 2, 4, 0.5, "bench"))  # compiles the schema, warms up
        for r in range(rounds):
            order = [("0%", 0.0), ("50%", 0.5)][:: 1 if r % 2 == 0 else -1]
            for name, share in order:
                settle([server.proc])
                sides[name].append(asyncio.run(run_side(server.url, server.model, streams, n, share, "bench")))
    results["sides"] = sides
    per_round = [ratio(s["tokens_per_s"], b["tokens_per_s"]) for s, b in zip(sides["50%"], sides["0%"])]
    results["ratio_50_over_0"] = statistics.median(per_round)
    print_table(f"{streams} streams of {n} tokens, {rounds} round(s)", ["side", "tokens/s (median)", "tokens"],
                [[name, f"{statistics.median(r['tokens_per_s'] for r in runs):.1f}", runs[0]["tokens"]]
                 for name, runs in sides.items()])
    c = results["compile"]
    print_table("compile", ["figure", "value"], [
        ["50% JSON schema / 0%: tokens/s", f"{results['ratio_50_over_0']:.3f}x (goal >= 0.9)"],
        [f"50-field schema ({c['schema_bytes']} B), median compile", f"{c['compile_median_ms']:.1f} ms"],
        ["one-off setup (tokenizer info)", f"{c['setup_s']:.2f} s"]])
    write_results("structured", results, run_mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
