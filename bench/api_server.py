"""The API server under streaming load, and the seed's claim about tokenization beside the scheduler.

On SmolLM2-135M-Instruct (float32, CPU), served by a real `LocalDeployment` (API server, engine
core and worker processes, 127.0.0.1), measured from this process with httpx async streaming:

(a) latency and throughput: C concurrent streaming completions (greedy, ignore_eos, the same
    number of output tokens each, distinct short prompts), multiprocess mode. TTFT is from
    sending the request to its first text chunk; ITL the gaps between consecutive text chunks
    of one stream (every chunk carries one token here; the table shows tokens per chunk).
    Throughput is generated tokens / wall time of the whole batch of C requests.
(b) the seed's claim: 4 decode streams run while a load process hammers the server with
    ~2000-token prompts, in two loads: "tokenize" (loops posting them to /tokenize) and
    "mixed" (loops to /tokenize plus loops to /v1/completions with max_tokens=1, which adds
    2000-token prefills to the core's steps). Both modes run at once (a multiprocess deployment
    and an in-process one, `--no-multiprocessing`, with the same engine settings: one torch
    thread, 256 batched tokens per step); round by round, the order of modes and phases flips.
    Each mode's loaded ITL p99 is divided by its own unloaded ITL p99 of the same run.
    The claim: the multiprocess ratio stays much closer to 1, because tokenization runs in the
    API server process, not beside the scheduler.

    python bench/api_server.py --quick      # 1/8/32 streams of 32 tokens; (b): 1 round, 12 tokens
    python bench/api_server.py              # 1/16/64 streams of 64 tokens; (b): 4 rounds, 64 tokens
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from common import Children, percentile, print_table, ratio, setup, write_results
from engine.api_server.local_deployment import LocalDeployment
from engine.model.default_model import default_model_dir

MODEL = "smollm2"
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy").split()
ENGINE_ARGS = ("--num-threads", "1", "--max-num-batched-tokens", "256")  # the in-process engine = the worker + core


def long_prompt(rng: random.Random, words: int) -> str:
    """Distinct (random) text, so that no prefill hits the prefix cache."""
    return f"{rng.randrange(10**9)} " + " ".join(rng.choice(WORDS) for _ in range(words))


# one streaming completion


async def stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    """Send time, chunk arrival times and the completion token count of one streamed completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunks, tokens = [], None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            if data.get("choices") and data["choices"][0].get("text"):
                chunks.append(now)
    return {"t0": t0, "chunks": chunks, "tokens": tokens}


async def run_streams(url: str, concurrency: int, max_tokens: int, tag: str) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        streams = await asyncio.gather(*(stream_completion(client, f"{tag} {i}: Once upon a time, in a city",
                                                           max_tokens) for i in range(concurrency)))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "ttft_s": [s["chunks"][0] - s["t0"] for s in streams],
            "itl_s": [b - a for s in streams for a, b in zip(s["chunks"], s["chunks"][1:])],
            "tokens": sum(s["tokens"] or 0 for s in streams), "chunks": sum(len(s["chunks"]) for s in streams)}


def summary(run: dict) -> dict:
    return {"ttft_p50_ms": percentile(run["ttft_s"], 50) * 1e3, "ttft_p99_ms": percentile(run["ttft_s"], 99) * 1e3,
            "itl_p50_ms": percentile(run["itl_s"], 50) * 1e3, "itl_p99_ms": percentile(run["itl_s"], 99) * 1e3,
            "tokens_per_s": run["tokens"] / run["wall_s"], "tokens_per_chunk": run["tokens"] / max(1, run["chunks"])}


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
                        r = await client.post("/tokenize", json={"model": MODEL, "prompt": prompt})
                        r.raise_for_status()
                        if len(done["prompt_tokens"]) < 3:
                            done["prompt_tokens"].append(len(r.json()["tokens"]))
                    else:
                        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
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


def start_load(children: Children, url: str, tokenize: int, completions: int, words: int, seed: int):
    proc = children.spawn([sys.executable, __file__, "--load", url, "--tokenize", str(tokenize), "--completions",
                           str(completions), "--prompt-words", str(words), "--seed", str(seed)],
                          stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    return proc


def stop_load(proc) -> dict:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


# (b) the claim


def claim(deployments: dict[str, LocalDeployment], children: Children, args) -> dict:
    loads = {"unloaded": (0, 0), "tokenize": (args.load_loops, 0),
             "mixed": (args.load_loops // 2, args.load_loops - args.load_loops // 2)}
    samples = {mode: {load: [] for load in loads} for mode in deployments}
    done = {mode: {load: [] for load in loads if load != "unloaded"} for mode in deployments}
    seed = 0
    for r in range(args.rounds):
        modes = list(deployments) if r % 2 == 0 else list(reversed(deployments))
        for mode in modes:
            url = deployments[mode].url
            for load in (loads if r % 2 == 0 else list(reversed(loads))):
                seed += 1
                tok, comp = loads[load]
                proc = start_load(children, url, tok, comp, args.prompt_words, seed) if tok + comp else None
                try:
                    if proc:
                        time.sleep(args.load_warmup_s)  # the first long prompts are in flight
                    run = asyncio.run(run_streams(url, args.decode_streams, args.decode_tokens, f"r{r} {mode} {load}"))
                finally:
                    got = stop_load(proc) if proc else None
                samples[mode][load] += run["itl_s"]
                if got:
                    done[mode][load].append(got)
                print(f"  round {r} {mode:13s} {load:9s} ITL p50 {percentile(run['itl_s'], 50) * 1e3:6.1f} ms  "
                      f"p99 {percentile(run['itl_s'], 99) * 1e3:6.1f} ms" + (f"  load {got}" if got else ""),
                      flush=True)
    figures = {}
    for mode in deployments:
        base = percentile(samples[mode]["unloaded"], 99)
        figures[mode] = {load: {"itl_p50_ms": percentile(s, 50) * 1e3, "itl_p99_ms": percentile(s, 99) * 1e3,
                                "ratio_p99_vs_unloaded": ratio(percentile(s, 99), base)}
                         for load, s in samples[mode].items()}
        for load, got in done[mode].items():
            secs = sum(g["seconds"] for g in got)
            figures[mode][load]["tokenize_per_s"] = sum(g["tokenize"] for g in got) / secs
            figures[mode][load]["completions_per_s"] = sum(g["completions"] for g in got) / secs
            figures[mode][load]["errors"] = sum(g["errors"] for g in got)
            figures[mode][load]["prompt_tokens"] = [t for g in got for t in g["prompt_tokens"]][:3]
    return {"figures": figures, "itl_samples_s": samples, "load_done": done, "loads": loads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--concurrency", default=None, help="comma-separated stream counts for (a)")
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="rounds of (b)")
    parser.add_argument("--decode-streams", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=None, help="tokens per decode stream in (b)")
    parser.add_argument("--load-loops", type=int, default=6, help="concurrent load loops in (b)")
    parser.add_argument("--prompt-words", type=int, default=2000, help="words of each long prompt (~1 token each)")
    parser.add_argument("--load-warmup-s", type=float, default=1.0)
    parser.add_argument("--parts", default="a,b")
    # the load process
    parser.add_argument("--load", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokenize", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--completions", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        return load_main(args)
    concurrency = [int(c) for c in (args.concurrency or ("1,8,32" if args.quick else "1,16,64")).split(",")]
    output_tokens = args.output_tokens or (32 if args.quick else 64)
    args.rounds = args.rounds or (1 if args.quick else 4)
    args.decode_tokens = args.decode_tokens or (12 if args.quick else 64)
    parts = set(args.parts.split(","))

    results = {"conditions": setup(1), "settings": {
        "concurrency": concurrency, "output_tokens": output_tokens, "rounds": args.rounds,
        "decode_streams": args.decode_streams, "decode_tokens": args.decode_tokens, "load_loops": args.load_loops,
        "prompt_words": args.prompt_words, "engine_args": ENGINE_ARGS}}
    model_dir = default_model_dir()
    with Children() as children:
        deployments: dict[str, LocalDeployment] = {}
        try:
            for mode in ("multiprocess", "in-process"):
                if mode == "in-process" and "b" not in parts:
                    break
                d = LocalDeployment(model_dir, tempfile.mkdtemp(prefix="vsup-bench-"), served_model_name=MODEL,
                                    max_model_len=4096, kv_cache_bytes=512 << 20, api_args=ENGINE_ARGS)
                children.own_shm(f"vsup-test-{d.tag}")
                deployments[mode] = d
                d.start(in_process=mode == "in-process")
            for mode, d in deployments.items():
                t = time.perf_counter()
                d.wait_ready(timeout_s=300)
                asyncio.run(run_streams(d.url, 2, 8, "warm-up"))  # first forward, first routes
                print(f"{mode} ready (+{time.perf_counter() - t:.1f} s)", flush=True)

            if "a" in parts:
                url, latency = deployments["multiprocess"].url, {}
                for c in concurrency:
                    run = asyncio.run(run_streams(url, c, output_tokens, f"a{c}"))
                    latency[c] = {**summary(run), "raw": run}
                    print(f"  {c} streams: {latency[c]['tokens_per_s']:.1f} tokens/s", flush=True)
                results["latency"] = latency
                print_table(f"(a) multiprocess, streaming completions of {output_tokens} tokens (ms, tokens/s)",
                            ["streams", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "tokens/s", "tok/chunk"],
                            [[c, s["ttft_p50_ms"], s["ttft_p99_ms"], s["itl_p50_ms"], s["itl_p99_ms"],
                              s["tokens_per_s"], s["tokens_per_chunk"]] for c, s in latency.items()])
            if "b" in parts:
                b = claim(deployments, children, args)
                results["claim"] = b
                f = b["figures"]
                rows = []
                for load in b["loads"]:
                    mp_, ip = f["multiprocess"][load], f["in-process"][load]
                    rows.append([load, mp_["itl_p50_ms"], mp_["itl_p99_ms"], mp_["ratio_p99_vs_unloaded"],
                                 ip["itl_p50_ms"], ip["itl_p99_ms"], ip["ratio_p99_vs_unloaded"],
                                 ratio(mp_["ratio_p99_vs_unloaded"], ip["ratio_p99_vs_unloaded"])])
                print_table(f"(b) ITL of {args.decode_streams} decode streams under long-prompt load (ms); "
                            f"ratio = p99 / own unloaded p99",
                            ["load", "MP p50", "MP p99", "MP ratio", "IP p50", "IP p99", "IP ratio", "MP/IP"], rows)
                print_table("(b) load served per second (requests/s)", ["load", "MP tokenize", "MP compl",
                                                                        "IP tokenize", "IP compl"],
                            [[load, f["multiprocess"][load]["tokenize_per_s"], f["multiprocess"][load]["completions_per_s"],
                              f["in-process"][load]["tokenize_per_s"], f["in-process"][load]["completions_per_s"]]
                             for load in b["loads"] if load != "unloaded"])
        finally:
            for d in deployments.values():
                d.stop()
                shutil.rmtree(d.run_dir, ignore_errors=True)
    write_results("api_server", results)


if __name__ == "__main__":
    main()
