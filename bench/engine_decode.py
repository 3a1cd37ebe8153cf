"""Decode step of one Worker against transformers' own forward, and load times of the default model.

On SmolLM2-135M-Instruct (float32, CPU), a batch of prompts is prefilled once by each side:
ours into the paged KV cache, transformers into a DynamicCache. Each batch size then forks the
first B rows (ours: new requests whose full prompt blocks are shared and whose decode blocks are
fresh, as prefix caching would give them; theirs: a copy of the cache cut to B rows) and runs
decode steps, ours and theirs alternating step by step so both see the same context length and
the same machine noise. A step is, for ours, `Worker.execute` of one SchedulerOutput (state
update, attention metadata, forward, greedy sampling, tokens back as a list); for transformers,
`model(input_ids, attention_mask, past_key_values)` plus the argmax. Goal: ours / HF <= 1.0.

A third side, interleaved with the two, is the floor of a float32 step on this machine: the
worker's own linear layers (every layer's qkv, o, gate_up and down, then the LM head, from the
same packed weights) run back to back on B rows, and nothing else; called from C++ as our step
calls them (engine/ops/csrc/decoder_stack.cpp). Ours / floor says how much of a step is
attention, norms, sampling and Python; what is left is the weights' GEMMs.

Load times: the first conversion of the default model (GGUF -> safetensors, into a temporary
cache dir; the user's cache is untouched), a later start (`default_model_dir` finds it, a Worker
loads it), and `AutoModelForCausalLM.from_pretrained` of the same directory; the last two are
interleaved and both read from a warm page cache.

    python bench/engine_decode.py --quick      # about 40 s on a quiet 2-core machine
    python bench/engine_decode.py              # full (about 75 s): more steps and load rounds, a profile
    python bench/engine_decode.py --smoke      # seconds: batches 1 and 2, one step, no load times
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from common import add_mode_args, median_ms, mode, print_table, ratio, setup, timed, write_results
from engine.model import decode_stack
from engine.model.default_model import default_model_dir
from engine.ops import cpu_extension
from engine.wire.sampling_params import SamplingParams
from engine.wire.scheduler_output import CachedRequest, NewRequest, SchedulerOutput
from engine.worker.worker import Worker, WorkerConfig

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_args(p)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads for both sides (default 2)")
    p.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=64, help=f"a multiple of the block size {BLOCK_SIZE}")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per batch (quick 8, full 32)")
    p.add_argument("--load-rounds", type=int, default=None, help="later-start rounds (quick 3, full 7)")
    p.add_argument("--profile", action="store_true", help="profile a step at the largest batch (full: on)")
    p.add_argument("--skip-load", action="store_true", help="measure the decode step only")
    p.add_argument("--linear-dtype", default=None, choices=["bfloat16"],
                   help="our side's linears and the floor's (default: float32, the model's)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["bfloat16"],
                   help="our side's KV cache dtype (default: float32, the model's)")
    args = p.parse_args(argv)
    args.mode = mode(args)
    if args.mode == "smoke":  # seconds: two batch sizes, one step, no load times, no profile
        args.batches, args.steps, args.prompt_len, args.skip_load = "1,2", args.steps or 1, BLOCK_SIZE, True
    if args.prompt_len % BLOCK_SIZE or args.prompt_len < BLOCK_SIZE:
        p.error(f"--prompt-len must be a positive multiple of {BLOCK_SIZE}, so forked requests share only "
                f"full blocks")
    args.batches = sorted({int(b) for b in args.batches.split(",")})
    args.steps = args.steps or (8 if args.quick else 32)
    args.load_rounds = args.load_rounds or (3 if args.quick else 7)
    args.profile = args.profile or not args.quick
    return args


# load times


def measure_load(rounds: int, num_threads: int) -> dict:
    """Conversion once; then, interleaved, each side's load alone and load plus a first forward.

    transformers maps the safetensors file and reads weights lazily, so its load alone looks
    cheap and its first forward pays the rest; "ready" (load, then one 8-token prompt through
    the model) is the figure that compares like with like. Ours includes a small KV cache."""
    prompt = list(range(1000, 1008))
    with tempfile.TemporaryDirectory(prefix="vsup-bench-cache-") as cache:
        convert_s, model_dir = timed(lambda: default_model_dir(cache))
        spent: dict[str, list[float]] = {"ours_load_s": [], "ours_ready_s": [], "hf_load_s": [], "hf_ready_s": []}

        def ours():
            start = time.perf_counter()
            worker = Worker(WorkerConfig(model=str(default_model_dir(cache)), dtype="float32",
                                         block_size=BLOCK_SIZE, num_threads=num_threads))
            worker.init_device()
            worker.load_model()
            loaded = time.perf_counter()
            worker.initialize_cache(2)
            worker.execute(SchedulerOutput(1, new_requests=[NewRequest("r", prompt, len(prompt), GREEDY, [1])],
                                           num_scheduled_tokens={"r": len(prompt)}))
            ready = time.perf_counter()
            worker.shutdown()
            return loaded - start, ready - start

        @torch.inference_mode()
        def theirs():
            start = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            loaded = time.perf_counter()
            model(input_ids=torch.tensor([prompt])).logits[:, -1].argmax(-1)
            return loaded - start, time.perf_counter() - start

        for i in range(rounds + 1):  # the first round warms imports and the page cache
            for name, fn in (("ours", ours), ("hf", theirs)) if i % 2 else (("hf", theirs), ("ours", ours)):
                load_s, ready_s = fn()
                gc.collect()
                if i:
                    spent[f"{name}_load_s"].append(load_s)
                    spent[f"{name}_ready_s"].append(ready_s)
    return {"convert_s": convert_s, **spent}


# the two sides


class OurDecode:
    """One Worker with the prompts prefilled in its paged cache; `fork(n)` starts n decoders."""

    def __init__(self, model_dir: str, prompts: torch.Tensor, max_new: int, num_threads: int,
                 kv_cache_dtype: str | None = None, linear_dtype: str | None = None):
        num_prompts, prompt_len = prompts.shape
        self.prompt_len, self.max_new = prompt_len, max_new
        self.prompt_blocks = prompt_len // BLOCK_SIZE
        self.decode_blocks = -(-max_new // BLOCK_SIZE)
        num_blocks = 1 + num_prompts * (self.prompt_blocks + self.decode_blocks)  # block 0 stays unused
        self.worker = Worker(WorkerConfig(model=model_dir, dtype="float32", block_size=BLOCK_SIZE,
                                          num_threads=num_threads, kv_cache_dtype=kv_cache_dtype,
                                          linear_dtype=linear_dtype))
        self.worker.init_device()
        self.worker.load_model()
        self.worker.initialize_cache(num_blocks)
        self.prompts = prompts.tolist()
        new = [NewRequest(f"p{i}", p, prompt_len, GREEDY, self._prompt_block_ids(i))
               for i, p in enumerate(self.prompts)]
        self.first_tokens = []
        self.step_id = 0
        for chunk in range(0, num_prompts, 16):  # 16 prompts a step keeps prefill activations small
            batch = new[chunk:chunk + 16]
            out = self._execute(SchedulerOutput(0, new_requests=batch,
                                                num_scheduled_tokens={n.req_id: prompt_len for n in batch}))
            self.first_tokens += out.sampled_token_ids

    def _prompt_block_ids(self, i: int) -> list[int]:
        return list(range(1 + i * self.prompt_blocks, 1 + (i + 1) * self.prompt_blocks))

    def _execute(self, scheduler_output):
        self.step_id += 1
        scheduler_output.step_id = self.step_id
        return self.worker.execute(scheduler_output)

    def fork(self, n: int) -> OurDecoders:
        return OurDecoders(self, n)


class OurDecoders:
    """n requests in decode, each continuing one prefilled prompt: a step is one Worker.execute."""

    def __init__(self, parent: OurDecode, n: int):
        self.parent = parent
        first_free = 1 + len(parent.prompts) * parent.prompt_blocks
        self.req_ids = [f"f{n}-{i}" for i in range(n)]
        self.tokens = [[t] for t in parent.first_tokens[:n]]
        self.num_computed = parent.prompt_len
        new = []
        for i, req_id in enumerate(self.req_ids):
            fresh = list(range(first_free + i * parent.decode_blocks, first_free + (i + 1) * parent.decode_blocks))
            new.append(NewRequest(req_id, parent.prompts[i] + self.tokens[i], parent.prompt_len, GREEDY,
                                  parent._prompt_block_ids(i) + fresh, parent.prompt_len))
        self.pending = SchedulerOutput(0, new_requests=new, num_scheduled_tokens=dict.fromkeys(self.req_ids, 1))

    def step(self) -> float:
        """Run one decode step; returns its seconds."""
        seconds, out = timed(lambda: self.parent._execute(self.pending))
        self.num_computed += 1
        for tokens, token in zip(self.tokens, out.sampled_token_ids):
            tokens.append(token)
        self.pending = SchedulerOutput(0, cached_requests=[
            CachedRequest(r, self.num_computed, [t[-1]]) for r, t in zip(self.req_ids, self.tokens)],
            num_scheduled_tokens=dict.fromkeys(self.req_ids, 1))
        return seconds

    def close(self) -> None:
        self.parent._execute(SchedulerOutput(0, finished_req_ids=self.req_ids))


class HfDecode:
    """transformers' model with the same prompts prefilled into a DynamicCache."""

    def __init__(self, model_dir: str, prompts: torch.Tensor):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            out = self.model(input_ids=prompts, attention_mask=torch.ones_like(prompts), past_key_values=self.cache,
                             use_cache=True, logits_to_keep=1)
        self.first_tokens = out.logits[:, -1].argmax(-1)
        self.prompt_len = prompts.shape[1]

    def fork(self, n: int) -> HfDecoders:
        return HfDecoders(self, n)


class HfDecoders:
    """The first n rows of the prefilled batch, decoding with their own copy of the cache."""

    def __init__(self, parent: HfDecode, n: int):
        self.model = parent.model
        self.cache = copy.deepcopy(parent.cache)
        self.cache.batch_select_indices(torch.arange(n))
        self.tokens = [[t] for t in parent.first_tokens[:n].tolist()]
        self.next = parent.first_tokens[:n].clone()
        self.context = parent.prompt_len

    @torch.inference_mode()
    def step(self) -> float:
        def forward():
            mask = torch.ones(len(self.tokens), self.context + 1, dtype=torch.long)
            out = self.model(input_ids=self.next[:, None], attention_mask=mask, past_key_values=self.cache,
                             use_cache=True)
            return out.logits[:, -1].argmax(-1)

        seconds, self.next = timed(forward)
        self.context += 1
        for tokens, token in zip(self.tokens, self.next.tolist()):
            tokens.append(token)
        return seconds

    def close(self) -> None:
        self.cache = None


class LinearFloor:
    """The Worker's linear layers alone, back to back on B rows: a decode step's GEMMs. From C++ (the
    decoder stack's linears_alone, engine/ops/csrc/decoder_stack.cpp), as our step calls them, then
    the LM head; where the stack cannot be built (no CPU kernels), one Python call each."""

    def __init__(self, parent: OurDecode, n: int):
        model = parent.worker.runner.model
        layers = list(model.model.layers.values())
        self.stack = decode_stack.build(layers, model.config.rms_norm_eps) if cpu_extension.load() else None
        # (module, its input width): the dense weights are freed once packed, so not weight.shape
        self.linears = [(m, width) for layer in layers for m, width in (
            (layer.self_attn.qkv_proj, layer.self_attn.qkv_proj.input_size),
            (layer.self_attn.o_proj, layer.self_attn.o_proj.shard_size),
            (layer.mlp.gate_up_proj, layer.mlp.gate_up_proj.input_size),
            (layer.mlp.down_proj, layer.mlp.down_proj.shard_size))]
        self.lm_head = model.lm_head
        self.rows = n
        sizes = {width for _, width in self.linears} | {self.lm_head.hidden_size}
        self.inputs = {size: torch.randn(n, size) for size in sizes}

    @torch.inference_mode()
    def step(self) -> float:
        def forward():
            if self.stack is not None:
                self.stack.linears_alone(self.rows)
            else:
                for linear, width in self.linears:
                    linear(self.inputs[width])
            return self.lm_head.logits(self.inputs[self.lm_head.hidden_size])

        return timed(forward)[0]

    def close(self) -> None:
        self.inputs = {}


# the comparison


def compare_decode(ours: OurDecode, theirs: HfDecode, batch: int, steps: int, warmup: int) -> dict:
    mine, hf, floor = ours.fork(batch), theirs.fork(batch), LinearFloor(ours, batch)
    sides = [("ours", mine), ("hf", hf), ("floor", floor)]
    times = {name: [] for name, _ in sides}
    for i in range(warmup + steps):
        for name, side in sides[i % 3:] + sides[:i % 3]:  # the order rotates every step
            seconds = side.step()
            if i >= warmup:
                times[name].append(seconds)
    agree = sum(a == b for a, b in zip(mine.tokens, hf.tokens)) / batch
    for _, side in sides:
        side.close()
    paired = [a / b for a, b in zip(times["ours"], times["hf"])]
    return {"batch": batch, "context": ours.prompt_len, "steps": steps, "ours_s": times["ours"], "hf_s": times["hf"],
            "floor_s": times["floor"], "ours_ms": median_ms(times["ours"]), "hf_ms": median_ms(times["hf"]),
            "floor_ms": median_ms(times["floor"]),
            "ratio": ratio(median_ms(times["ours"]), median_ms(times["hf"])),
            "ours_over_floor": ratio(median_ms(times["ours"]), median_ms(times["floor"])),
            "paired_ratio_median": statistics.median(paired), "greedy_rows_agree": agree}


def profile_step(ours: OurDecode, theirs: HfDecode, batch: int, steps: int) -> dict:
    """Self CPU time per aten op over `steps` decode steps of each side: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    tables = {}
    for name, parent in (("ours", ours), ("hf", theirs)):
        side = parent.fork(batch)
        side.step()  # ours: the NewRequest step
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            total = sum(side.step() for _ in range(steps))
        side.close()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        top = [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps}
               for e in events[:12]]
        tables[name] = {"ms_per_step_under_profiler": total / steps * 1e3, "top_ops": top}
        print_table(f"profile, {name}, batch {batch}: self CPU ms per step (step {total / steps * 1e3:.1f} ms "
                    f"under the profiler)", ["op", "ms/step", "calls/step"],
                    [[t["op"], t["self_ms_per_step"], f"{t['calls_per_step']:.0f}"] for t in top])
    return tables


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    conditions = setup(args.threads)
    results: dict = {"conditions": conditions, "args": {k: v for k, v in vars(args).items()}}
    print(f"engine_decode: {args.threads} torch threads, {conditions['cpu_count']} CPUs, "
          f"load average {conditions['load_average_at_start'][0]:.2f}")

    if not args.skip_load:
        load = measure_load(args.load_rounds, args.threads)
        results["load"] = load
        m = {k: statistics.median(v) for k, v in load.items() if k != "convert_s"}
        print_table(f"default model load, seconds (median of {args.load_rounds}, warm page cache)",
                    ["what", "load", "ready", "ours/HF load", "ours/HF ready"], [
                        ["first conversion (GGUF -> safetensors)", load["convert_s"], "", "", ""],
                        ["later start: Worker.load_model (+ first forward)", m["ours_load_s"], m["ours_ready_s"],
                         f"{ratio(m['ours_load_s'], m['hf_load_s']):.2f}",
                         f"{ratio(m['ours_ready_s'], m['hf_ready_s']):.2f}"],
                        ["HF from_pretrained (+ first forward)", m["hf_load_s"], m["hf_ready_s"], "", ""]])

    model_dir = str(default_model_dir())
    warmup = 2
    prompts = torch.randint(100, 49000, (max(args.batches), args.prompt_len),
                            generator=torch.Generator().manual_seed(0))
    ours = OurDecode(model_dir, prompts, max_new=warmup + args.steps + 2, num_threads=args.threads,
                     kv_cache_dtype=args.kv_cache_dtype, linear_dtype=args.linear_dtype)
    theirs = HfDecode(model_dir, prompts)
    prefill_agree = sum(a == b for a, b in zip(ours.first_tokens, theirs.first_tokens.tolist())) / len(prompts)
    rows = [compare_decode(ours, theirs, b, args.steps, warmup) for b in args.batches]
    results["decode"] = rows
    results["prefill_first_token_agree"] = prefill_agree
    print_table(f"decode step, ms (median of {args.steps} steps, context {args.prompt_len}+, float32 model, linears "
                f"{args.linear_dtype or 'float32'}, KV cache {args.kv_cache_dtype or 'float32'}; ours, HF and the "
                f"linear floor in turn)",
                ["batch", "ours ms", "HF ms", "ours/HF", "paired", "rows agree", "goal", "floor ms", "ours/floor"],
                [[r["batch"], r["ours_ms"], r["hf_ms"], f"{r['ratio']:.2f}", f"{r['paired_ratio_median']:.2f}",
                  f"{r['greedy_rows_agree']:.0%}", "<= 1.0", r["floor_ms"], f"{r['ours_over_floor']:.2f}"]
                 for r in rows])
    if args.profile:
        results["profile"] = profile_step(ours, theirs, max(args.batches), min(args.steps, 8))
    ours.worker.shutdown()
    write_results("engine_decode", results, args.mode)


if __name__ == "__main__":
    main()
