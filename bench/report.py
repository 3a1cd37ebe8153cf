"""One report of every bench: bench/results/*.json -> bench/results/REPORT.md and PNG plots beside it.

Every figure is a ratio of two things measured side by side in one run (these machines are
noisy: absolute times move by 2x from one minute to the next, ratios much less). Each section
names the JSON it comes from and the conditions it was measured under; a missing input is named
with the bench that writes it. Reads and writes `--results-dir` (default: `$VSUP_BENCH_RESULTS`
or bench/results).

    python bench/report.py [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LATENCY_FIGURES, RESULTS_ENV, results_dir  # noqa: E402

BENCHES = {
    "api_server": "bench/api_server.py",
    "engine_core": "bench/engine_core.py",
    "engine_decode": "bench/engine_decode.py",
    "ring_buffer": "bench/ring_buffer.py",
    "supervisor": "bench/supervisor.py",
    "soak": "bench/soak.py",
    "plan_latency": "bench/plan_latency.py",
    "vllm_cpu": "bench/vllm_cpu.py",
    "vllm_supervised": "bench/vllm_supervised.py",
    "scaling": "bench/scaling.py",
    "structured": "bench/structured.py",
    "peers": "bench/peers.py",
    "front_relay": "bench/front_relay.py",
}
SECTIONS = ("Conditions", "Serving", "Against peers at their defaults", "The front's relay", "Engine overhead",
            "The seed's claim", "The supervisor", "Scaling", "Structured outputs", "Against the goals",
            "Missing inputs")
# issue 20: a decode step within these multiples of its floor (the float32 linears alone), by batch
FLOOR_GOALS = {1: 1.2, 16: 1.25, 64: 1.25}
BASELINES = {"hf_batch": "HF generate, padded batch", "hf_one_by_one": "HF generate, one by one", "vllm": "vLLM-CPU"}
COLORS = {"hf_batch": "#4C72B0", "hf_one_by_one": "#DD8452", "vllm": "#55A868"}
GPU_PARAGRAPH = (
    "What a GPU run would add: `python bench/scaling.py --device cuda` runs the same configurations with one "
    "GPU per worker. There TP=2 splits every matmul across two devices joined by NCCL all-reduces, so the "
    "per-token time of a memory-bound decode drops towards half, minus the all-reduce per layer; DP=2 "
    "runs two engine cores on two GPUs and should come close to 2x at 16 streams (each core gets 8), the "
    "coordinator's overhead being the gap. On this CPU machine the workers of every configuration share "
    "the same cores (vsup pins each worker to its share of them, cores / workers, with as many threads; "
    "and the configurations run side by side), so the ratios above show what the split "
    "costs in processes, messages and all-reduces, not what it gains in compute. A GPU run would also "
    "separate the CPU work of the API server, engine core and tokenization from the model's, which on "
    "2 shared cores compete (see the seed's claim).")


class Report:
    def __init__(self, directory: Path):
        self.dir = directory
        self.lines: list[str] = []
        self.figures: list[str] = []
        self.missing: list[tuple[str, str]] = []
        self.goals: list[tuple[str, str, str]] = []
        self.data: dict[str, dict] = {}
        for name in BENCHES:
            path = directory / f"{name}.json"
            if path.exists():
                try:
                    self.data[name] = json.loads(path.read_text())
                except ValueError as e:
                    self.missing.append((name, f"{path.name} is not valid JSON ({e})"))

    # helpers

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def need(self, name: str, key: str | None = None, why: str = "") -> dict | None:
        """The JSON of bench `name` (and its `key`), or None after noting what to run."""
        found = self.data.get(name)
        if found is not None and (key is None or found.get(key) is not None):
            return found if key is None else found[key]
        what = f"`{name}.json`" + (f" has no `{key}`" if found is not None and key else " is missing")
        run = f"`.venv/bin/python {BENCHES[name]} --quick`" + (f" ({why})" if why else "")
        self.missing.append((name, f"{what}: run {run}"))
        self.add(f"*Not measured: {what}; run {run}.*", "")
        return None

    def source(self, name: str) -> None:
        c = self.data.get(name, {}).get("conditions", {})
        self.add(f"<sub>From `{name}.json`: {c.get('mode', '?')} run of {c.get('date', '?')}, commit "
                 f"{c.get('git_commit', '?')}, load average {_load(c)}.</sub>", "")

    def figure(self, name: str, caption: str, draw: Callable[[], plt.Figure]) -> None:
        fig = draw()
        fig.tight_layout()
        fig.savefig(self.dir / name, dpi=110)
        plt.close(fig)
        self.figures.append(name)
        self.add(f"![{caption}]({name})", "", f"*{caption}*", "")

    def goal(self, goal: str, figure: str, status: str) -> None:
        self.goals.append((goal, figure, status))

    def section(self, title: str, body: Callable[[], None]) -> None:
        self.add(f"## {title}", "")
        try:
            body()
        except Exception as e:  # one malformed input must not cost the whole report
            self.add(f"*This section could not be built: {type(e).__name__}: {e}*", "")
            traceback.print_exc()

    # sections

    def conditions(self) -> None:
        self.add("Each bench runs the things it compares interleaved in one process and one run; the figures "
                 "that count are the ratios. Conditions of each input:", "",
                 "| bench | mode | date (UTC) | commit | CPUs | torch threads | load average start -> end | versions |",
                 "|---|---|---|---|---|---|---|---|")
        for name in BENCHES:
            c = self.data.get(name, {}).get("conditions")
            if c is None:
                self.add(f"| {name} | *missing* | | | | | | |")
                continue
            versions = ", ".join(f"{k} {v}" for k, v in c.get("versions", {}).items())
            self.add(f"| {name} | {c.get('mode', '?')} | {c.get('date', '?')} | {c.get('git_commit', '?')} | "
                     f"{c.get('cpu_count', '?')} | {c.get('torch_threads') or '-'} | {_load(c)} | {versions} |")
        self.add("")

    def serving(self) -> None:
        self.add("vsup serving streaming completions (`vsup serve`, default settings) against transformers "
                 "`generate` in the bench process (a padded batch of the same prompts, and one request at a time) "
                 "and vLLM's CPU build in its own venv, all on the default model, greedy, ignore_eos, the same "
                 "prompts, round by round in one run.", "")
        vllm = self.data.get("api_server", {}).get("vllm") or self.data.get("vllm_cpu", {}).get("detect")
        if vllm is None:
            self.add("vLLM-CPU: unknown (no api_server.json or vllm_cpu.json).", "")
        elif vllm.get("used"):
            self.add(f"vLLM-CPU {vllm.get('version')} was measured side by side (threads bound to "
                     f"{'every CPU' if vllm.get('bind') == 'all' else 'its default placement'}).", "")
        elif vllm.get("available"):
            self.add(f"vLLM-CPU {vllm.get('version')} is installed but was not measured in this run"
                     f"{': ' + vllm['why_not'] if vllm.get('why_not') else ' (smoke mode, or --no-vllm)'}.", "")
        else:
            self.add(f"**vLLM-CPU is not in this run**: {vllm.get('why_not')}", "")
        a = self.need("api_server", "serving", "part (a)")
        if a is not None:
            self.source("api_server")
            sides = list(a["sides"])
            self.add(f"{a['output_tokens']} tokens per stream; tokens/s the median of {a['rounds']} round(s); "
                     f"HF one by one: {a['hf_sequential_requests']} request(s) measured per round, the others "
                     "queued behind them (their TTFT includes the wait).", "",
                     "| streams | side | tokens/s | vsup / side | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
                     "|---|---|---|---|---|---|---|---|")
            for row in a["rows"]:
                for s in sides:
                    r = row[s]
                    vs = f"**{row[f'vsup_over_{s}_throughput']:.2f}x**" if s != "vsup" else ""
                    self.add(f"| {row['streams']} | {a['sides'][s]} | {r['tokens_per_s']:.1f} | {vs} | "
                             f"{_f(r['ttft_p50_ms'])} | {_f(r['ttft_p99_ms'])} | {_f(r['itl_p50_ms'])} | "
                             f"{_f(r['itl_p99_ms'])} |")
            self.add("")
            baselines = [s for s in sides if s != "vsup"]
            streams = [row["streams"] for row in a["rows"]]

            def throughput():
                fig, ax = plt.subplots(figsize=(7, 4))
                width = 0.8 / len(baselines)
                for i, s in enumerate(baselines):
                    values = [row[f"vsup_over_{s}_throughput"] for row in a["rows"]]
                    xs = [j + (i - (len(baselines) - 1) / 2) * width for j in range(len(streams))]
                    bars = ax.bar(xs, values, width, label=f"vs {BASELINES[s]}", color=COLORS.get(s))
                    ax.bar_label(bars, fmt="%.2f", fontsize=8)
                ax.axhline(1.0, color="black", lw=0.8)
                if "vllm" in baselines:
                    ax.axhline(1.5, color=COLORS["vllm"], lw=0.8, ls="--", label="goal vs vLLM-CPU: 1.5x")
                ax.set_xticks(range(len(streams)), [f"{c} stream{'s' * (c > 1)}" for c in streams])
                ax.set_ylabel("vsup tokens/s / theirs (higher: vsup faster)")
                ax.set_title(f"Serving throughput, vsup over each ({a['output_tokens']} tokens/stream)")
                ax.legend(fontsize=8)
                return fig

            self.figure("serving_throughput.png", "Serving throughput: vsup's tokens/s over each side's, same run",
                        throughput)

            def latency():
                metrics = [("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("itl_p50_ms", "ITL p50"),
                           ("itl_p99_ms", "ITL p99")]
                fig, axes = plt.subplots(1, len(baselines), figsize=(4.2 * len(baselines), 4), squeeze=False)
                for ax, s in zip(axes[0], baselines):
                    width = 0.8 / len(metrics)
                    for i, (key, label) in enumerate(metrics):
                        values = [_ratio(row["vsup"][key], row[s][key]) for row in a["rows"]]
                        xs = [j + (i - (len(metrics) - 1) / 2) * width for j in range(len(streams))]
                        bars = ax.bar(xs, values, width, label=label)
                        ax.bar_label(bars, fmt="%.2g", fontsize=6)
                    ax.axhline(1.0, color="black", lw=0.8)
                    _log_y(ax)
                    ax.set_xticks(range(len(streams)), [str(c) for c in streams])
                    ax.set_xlabel("concurrent streams")
                    ax.set_title(f"vsup / {BASELINES[s]}", fontsize=9)
                axes[0][0].set_ylabel("vsup latency / theirs (below 1: vsup faster)")
                axes[0][0].legend(fontsize=7)
                return fig

            self.figure("serving_latency.png", "TTFT and ITL, p50 and p99: vsup's over each side's (log scale)",
                        latency)
            for row in a["rows"]:
                if "vllm" in sides and row["streams"] in (16, 64):
                    v = row["vsup_over_vllm_throughput"]
                    self.goal(f"serving throughput vsup / vLLM-CPU >= 1.5 at {row['streams']} streams",
                              f"{v:.2f}", "met" if v >= 1.5 else "not met")
                if row["streams"] in (16, 64):
                    self.goal(f"serving throughput vsup / HF batch at {row['streams']} streams (no goal set)",
                              f"{row['vsup_over_hf_batch_throughput']:.2f}", "-")
            if "vllm" not in sides:
                self.goal("serving throughput vsup / vLLM-CPU >= 1.5 at 16 and 64 streams", "-",
                          "not measured (no vLLM-CPU in this run)")
            else:
                self.goal_bound(a)

        self.add("### The engine alone, in process, against transformers", "")
        t = self.need("engine_core", "throughput", "part (a)")
        if t is not None:
            self.source("engine_core")
            self.add("An in-process `EngineCore` stepped between the forwards of transformers' `generate` on the "
                     "same prompts, each side charged its own time (no HTTP, no tokenization).", "",
                     "| requests | ours tok/s | HF batch tok/s | ours/HF batch e2e (paired) | decode | ours/HF one by one | rows agree |",
                     "|---|---|---|---|---|---|---|")
            for r in t:
                self.add(f"| {r['concurrency']} | {r['ours_e2e_tok_s']:.1f} | {r['hf_batch_e2e_tok_s']:.1f} | "
                         f"{r['ours_over_hf_batch_e2e']:.2f} ({r['ours_over_hf_batch_e2e_paired']:.2f}) | "
                         f"{r['ours_over_hf_batch_decode']:.2f} | {r['ours_over_hf_sequential_e2e']:.2f} | "
                         f"{r['greedy_rows_agree_with_hf_batch']:.0%} |")
            self.add("")

            def engine():
                fig, ax = plt.subplots(figsize=(7, 4))
                xs = range(len(t))
                series = [("ours_over_hf_batch_e2e", "vs HF batch, e2e"), ("ours_over_hf_batch_decode",
                                                                          "vs HF batch, decode"),
                          ("ours_over_hf_sequential_e2e", "vs HF one by one, e2e")]
                width = 0.8 / len(series)
                for i, (key, label) in enumerate(series):
                    bars = ax.bar([x + (i - 1) * width for x in xs], [r[key] for r in t], width, label=label)
                    ax.bar_label(bars, fmt="%.2f", fontsize=7)
                ax.axhline(1.0, color="black", lw=0.8)
                _log_y(ax)
                ax.set_xticks(list(xs), [str(r["concurrency"]) for r in t])
                ax.set_xlabel("concurrent requests")
                ax.set_ylabel("ours tokens/s / HF's (log)")
                ax.set_title("In-process EngineCore over transformers generate")
                ax.legend(fontsize=8)
                return fig

            self.figure("engine_throughput.png", "In-process EngineCore tokens/s over transformers', same run",
                        engine)
        d = self.need("engine_decode", "decode")
        if d is not None:
            self.source("engine_decode")

            def decode():
                fig, ax = plt.subplots(figsize=(6, 3.6))
                xs = range(len(d))
                ax.bar([x - 0.2 for x in xs], [r["ratio"] for r in d], 0.4, label="ratio of medians")
                ax.bar([x + 0.2 for x in xs], [r["paired_ratio_median"] for r in d], 0.4, label="paired (median)")
                ax.axhline(1.0, color="black", lw=0.8, ls="--", label="goal <= 1.0")
                ax.set_xticks(list(xs), [str(r["batch"]) for r in d])
                ax.set_xlabel("batch")
                ax.set_ylabel("ours ms / HF ms (lower: ours faster)")
                ax.set_ylim(0, max(1.3, *(r["ratio"] * 1.1 for r in d)))
                ax.set_title("One decode step: Worker.execute over HF forward")
                ax.legend(fontsize=8)
                return fig

            self.add("*floor*: the worker's linear layers and LM head alone on the same rows, from the same packed "
                     "weights, in turn with the two steps: the float32 GEMMs no engine on this machine avoids.", "",
                     "| batch | ours ms | HF ms | ours/HF | paired | rows agree | floor ms | ours/floor |",
                     "|---|---|---|---|---|---|---|---|")
            for r in d:
                self.add(f"| {r['batch']} | {_f(r['ours_ms'])} | {_f(r['hf_ms'])} | {r['ratio']:.2f} | "
                         f"{r['paired_ratio_median']:.2f} | {r['greedy_rows_agree']:.0%} | "
                         f"{_f(r.get('floor_ms'))} | {r.get('ours_over_floor', float('nan')):.2f} |")
                self.goal(f"decode step ours/HF <= 1.0 at batch {r['batch']}", f"{r['paired_ratio_median']:.2f} "
                          "(paired)", "met" if r["paired_ratio_median"] <= 1.0 else "not met")
                if r["batch"] in FLOOR_GOALS and "ours_over_floor" in r:
                    bound, x = FLOOR_GOALS[r["batch"]], r["ours_over_floor"]
                    self.goal(f"decode step ours/floor <= {bound} at batch {r['batch']}", f"{x:.2f}",
                              "met" if x <= bound else "not met")
            self.add("")
            self.figure("decode_step.png", "Decode step time, ours over transformers', by batch", decode)

    def goal_bound(self, a: dict) -> None:
        """What 1.5x vLLM-CPU's throughput asks of a decode step, against the float32 floor that
        engine_decode measured (its batch = the number of streams)."""
        floors = {r["batch"]: r.get("floor_ms") for r in (self.data.get("engine_decode") or {}).get("decode", [])}
        n = a["output_tokens"]
        lines = []
        for row in a["rows"]:
            c, v = row["streams"], row["vllm"]
            if c not in (16, 64) or n < 2 or floors.get(c) is None:
                continue
            # at vLLM's own time to first token, the time between tokens that gives 1.5x its tokens/s
            wall = v["ttft_p50_ms"] + (n - 1) * v["itl_p50_ms"]
            needed = (wall / 1.5 - v["ttft_p50_ms"]) / (n - 1)
            lines.append(f"- {c} streams: vLLM-CPU's ITL p50 is {v['itl_p50_ms']:.0f} ms; 1.5x its throughput "
                         f"needs vsup's at {needed:.0f} ms, {needed / floors[c]:.2f}x the linear floor of a batch "
                         f"of {c} ({floors[c]:.0f} ms; vsup's ITL p50: {row['vsup']['itl_p50_ms']:.0f} ms).")
        if lines:
            self.add("What the 1.5x goal asks of a step (engine_decode's floor: the float32 linear layers alone, "
                     "no attention, norms, sampling, IPC or HTTP, and nothing else running on the cores):", "",
                     *lines, "")

    def overhead(self) -> None:
        e = self.need("engine_core") or {}
        if e:
            self.source("engine_core")
        bars: list[tuple[str, float, float | None, str]] = []  # label, value, goal, direction
        s = e.get("step_overhead")
        if s:
            self.add(f"- **core step / bare forward** (batch {s['batch']}, {s['steps']} decode steps): "
                     f"`EngineCore.step` {_f(s['step_ms'])} ms against `Worker.execute` {_f(s['execute_ms'])} ms: "
                     f"**{s['ratio_of_sums']:.3f}** (overhead {s['overhead_ms_median']:.2f} ms a step)")
            bars.append(("core step / forward", s["ratio_of_sums"], 1.15, "<="))
            self.goal("core step / bare forward <= 1.15", f"{s['ratio_of_sums']:.3f}",
                      "met" if s["ratio_of_sums"] <= 1.15 else "not met")
        m = e.get("multiprocess")
        if m:
            self.add(f"- **multiprocess / in-process throughput** ({m['concurrency']} requests, {m['output_tokens']} "
                     f"tokens, {m['rounds']} round(s)): e2e **{m['ratio_e2e']:.3f}** (paired {m['ratio_e2e_paired']:.3f}), "
                     f"decode {m['ratio_decode']:.3f}, per CPU second {m['ratio_per_cpu_s']:.3f}")
            bars += [("multiprocess / in-process, e2e", m["ratio_e2e_paired"], 0.95, ">="),
                     ("multiprocess / in-process, decode", m["ratio_decode_paired"], 0.95, ">=")]
            self.goal("multiprocess / in-process >= 0.95", f"{m['ratio_e2e_paired']:.3f} e2e, "
                      f"{m['ratio_decode_paired']:.3f} decode (paired)",
                      "met" if min(m["ratio_e2e_paired"], m["ratio_decode_paired"]) >= 0.95 else "not met")
        ring = e.get("ring_round_trip")
        if ring:
            worst = max(r["p99_us"] for r in ring)
            self.add("- **ring-buffer round trip** (two hops, there and back): " + ", ".join(
                f"{r['payload']} p99 {r['p99_us']:.1f} us (median {r['median_us']:.1f})" for r in ring))
            bars += [(f"ring p99 / 100 us, {r['payload']}", r["p99_us"] / 100, 1.0, "<=") for r in ring]
            self.goal("ring round trip p99 <= 100 us", f"{worst:.1f} us (worst payload)",
                      "met" if worst <= 100 else "not met")
        rb = self.data.get("ring_buffer")
        if rb and rb.get("rows"):
            self.add("- **shm ring against ZeroMQ ipc** (`ring_buffer.json`): zmq / ring median round trip " + ", ".join(
                f"{_size(r['bytes'])} {r['zmq_over_ring_median']:.2f}x" for r in rb["rows"]))
            bars += [(f"ring / zmq ipc, {_size(r['bytes'])}", 1 / r["zmq_over_ring_median"], None, "")
                     for r in rb["rows"]]
        elif "ring_buffer" not in self.data:
            self.need("ring_buffer")
        self.add("")
        if bars:
            self.figure("overhead.png", "Engine overhead: each bar a ratio from one run, against its goal",
                        lambda: _ratio_bars(
                            "Engine overhead", "ratio (green: goal met, red: not met, grey: no goal)",
                            [(b[0], b[1], f" (goal {b[3]} {b[2]})" if b[2] else "",
                              "#55A868" if _meets(b) else "#C44E52" if b[2] else "#8C8C8C") for b in bars],
                            row_height=0.45, xmin=1.6, headroom=1.45))

    def claim(self) -> None:
        b = self.need("api_server", "claim", "part (b)")
        if b is None:
            return
        self.source("api_server")
        f, sides, loads = b["figures"], b["sides"], [ld for ld in b["loads"] if ld != "unloaded"]
        streams = list(next(iter(f.values()))["tokens_per_s"])
        self.add("Decode streams' ITL p99 under long-text load, over the same side's calm p99 (1.0 = the load "
                 "does not reach the decode), and each side's throughput, against vsup with the model on every "
                 "core (--cpu-reserve 0).", "",
                 "| side | calm ITL p99 ms | " + " | ".join(f"{ld} ITL p99 ms | {ld} ratio" for ld in loads)
                 + " | " + " | ".join(f"{c} streams tok/s (vs reserve 0)" for c in streams) + " |",
                 "|---|---|" + "---|---|" * len(loads) + "---|" * len(streams))
        for side, label in sides.items():
            vs = f[side].get("tokens_per_s_vs_reserve0", {})
            self.add(f"| {label} | {_f(f[side]['unloaded']['itl_p99_ms'])} | "
                     + " | ".join(f"{_f(f[side][ld]['itl_p99_ms'])} | {f[side][ld]['ratio_p99_vs_unloaded']:.2f}"
                                  for ld in loads) + " | "
                     + " | ".join(f"{_f(f[side]['tokens_per_s'][c])}" + (f" ({vs[c]:.2f})" if c in vs else "")
                                  for c in streams) + " |")
        self.add("")
        if "tokenize" in loads and "vsup" in f:
            got = f["vsup"]["tokenize"]["ratio_p99_vs_unloaded"]
            self.goal("seed's claim: under tokenize load, the default placement's ITL p99 ratio <= 1.2",
                      f"{got:.2f}", "holds in this run" if got <= 1.2 else "does not hold in this run")
        if "reserve0" in f and "vllm_all" in f:  # issue 20: the model on every core on both sides
            for c in streams:
                x = f["reserve0"]["tokens_per_s"][c] / f["vllm_all"]["tokens_per_s"][c]
                goal = " >= 1.3" if c in ("16", "64") else " (no goal set)"
                self.goal(f"throughput at {c} streams, vsup --cpu-reserve 0 / vLLM-CPU on both cores{goal}", f"{x:.2f}",
                          ("met" if x >= 1.3 else "not met") if c in ("16", "64") else "-")

        def draw():
            fig, ax = plt.subplots(figsize=(7, 3.8))
            xs = range(len(loads))
            width = 0.8 / len(sides)
            for i, (side, label) in enumerate(sides.items()):
                bars = ax.bar([x + (i - (len(sides) - 1) / 2) * width for x in xs],
                              [f[side][ld]["ratio_p99_vs_unloaded"] for ld in loads], width, label=label)
                ax.bar_label(bars, fmt="%.2f", fontsize=7)
            ax.axhline(1.0, color="black", lw=0.8)
            ax.axhline(1.2, color="grey", lw=0.8, ls="--")
            ax.set_xticks(list(xs), loads)
            ax.set_ylabel("ITL p99 loaded / calm")
            ax.set_title("Decode ITL p99 under long-text load")
            ax.legend(fontsize=7)
            return fig

        self.figure("claim.png", "The seed's claim: decode ITL p99 under load over calm, per side", draw)

    def supervisor(self) -> None:
        bars: list[tuple[str, float, str]] = []
        s = self.need("supervisor")
        if s is not None:
            self.source("supervisor")
            sv, log, ps = s.get("serve", {}), s.get("log", {}), s.get("ps", {})
            kill, first = sv.get("kill9_worker_to_next_token_s"), sv.get("cold_start_to_first_token_s")
            self.add(f"- cold start of `vsup serve` (default model) to /health: **{sv['cold_start_to_health_s']:.1f} s**, "
                     f"to the first token {first:.1f} s",
                     "- kill -9 of the worker to the next token of a running stream: "
                     + (f"**{kill:.1f} s** ({kill / first:.2f}x a cold start to the first token; the median gap "
                        f"between tokens is {sv['median_inter_token_s'] * 1e3:.0f} ms)" if kill else "no token after it"),
                     f"- log lines/s through the supervisor's router (tagged, into vsup.jsonl): "
                     f"**{log['routed_lines_per_s']:,.0f}**, {log['routed_over_direct']:.2f}x a child writing its "
                     f"own file ({log['direct_lines_per_s']:,.0f}/s)",
                     f"- the supervisor's CPU while the tree idles: **{sv['supervisor_idle_cpu_share']:.2%}** of a core",
                     f"- `vsup ps`: {ps['vsup_ps_s'] * 1e3:.0f} ms, **{ps['ratio']:.2f}x** `python -c \"import typer\"`")
            if kill:
                bars.append(("kill -9 to next token / cold start to first token", kill / first, "lower is better"))
            bars += [("log router lines/s / direct file", log["routed_over_direct"], "higher is better"),
                     ("vsup ps / import typer", ps["ratio"], "lower is better")]
            self.goal("`vsup ps` / `import typer` <= 1.3", f"{ps['ratio']:.2f}",
                      "met" if ps["ratio"] <= 1.3 else "not met")
            self.goal("log router lines/s / a child writing its own file >= 0.5", f"{log['routed_over_direct']:.2f}",
                      "met" if log["routed_over_direct"] >= 0.5 else "not met")
        p = self.need("plan_latency")
        if p is not None:
            self.add(f"- `vsup plan -tp 4`: {p['vsup_plan_s'] * 1e3:.0f} ms, **{p['ratio']:.2f}x** `import typer` "
                     f"({p['import_typer_s'] * 1e3:.0f} ms; median of {p['runs']}, alternating)")
            bars.append(("vsup plan / import typer", p["ratio"], "goal <= 1.3"))
            self.goal("`vsup plan` / `import typer` <= 1.3", f"{p['ratio']:.2f}", "met" if p["ratio"] <= 1.3 else "not met")
        v = self.data.get("vllm_cpu")
        if v is None:
            self.need("vllm_cpu")
        elif v.get("cold_start"):
            c = v["cold_start"]
            self.add(f"- cold start against vLLM-CPU {v['detect'].get('version')} (`vllm_cpu.json`, median of "
                     f"{c['rounds']}, alternating): to /health vsup {c['vsup_health_s']:.1f} s, vLLM "
                     f"{c['vllm_health_s']:.1f} s (**{c['vsup_over_vllm_health']:.2f}x**); to the first token "
                     f"{c['vsup_first_token_s']:.1f} s against {c['vllm_first_token_s']:.1f} s "
                     f"({c['vsup_over_vllm_first_token']:.2f}x)")
            bars += [("cold start to /health, vsup / vLLM-CPU", c["vsup_over_vllm_health"], "lower is better"),
                     ("cold start to first token, vsup / vLLM-CPU", c["vsup_over_vllm_first_token"], "lower is better")]
            self.goal("cold start to /health vsup / vLLM-CPU (no goal set)", f"{c['vsup_over_vllm_health']:.2f}", "-")
        else:
            why = v["detect"].get("why_not") or "smoke mode: detection only"
            self.add(f"- cold start against vLLM-CPU: not measured ({why})")
        w = self.data.get("vllm_supervised")
        if w is None:
            self.need("vllm_supervised")
        elif w.get("side_by_side"):
            s, h = w["side_by_side"], w.get("heal") or {}
            tput = [(int(k.rsplit("_", 1)[1]), x) for k, x in s.items() if k.startswith("vsup_over_vllm_tok_s_")]
            self.add(f"- vsup around a stock vLLM-CPU {w['detect'].get('version')} (`vllm_supervised.json`, medians "
                     f"of {s['rounds']} alternating rounds, both at vLLM's defaults): cold start to /health "
                     f"{s['health_extra_s']:+.1f} s (goal <= +1 s); throughput "
                     + ", ".join(f"{n} streams **{x:.3f}x**" for n, x in sorted(tput)) + " (goal >= 0.98x); "
                     + "".join(f"ITL p50 {s.get(f'itl_p50_ratio_{n}', float('nan')):.3f}x "
                               f"({s[f'itl_p50_extra_ms_{n}']:+.2f} ms) at {n} streams (goal <= 1.02x); "
                               for n, _ in sorted(tput) if f"itl_p50_extra_ms_{n}" in s)
                     + f"{h.get('log_lines_per_s', float('nan')):.0f} log lines/s from one process; kill -9 of the "
                     f"worker to the running stream's next token {_f(h.get('kill_worker_to_streams_next_token_s'))} "
                     f"s (the front resumes it; bare vLLM fails it and exits), to the next new request served "
                     f"{_f(h.get('kill_worker_to_next_token_s'))} s")
            for n, x in sorted(tput):
                bars.append((f"{n} streams, vsup --engine vllm / bare vLLM", x, "goal >= 0.98"))
                self.goal(f"throughput at {n} streams, vsup around vLLM / bare vLLM >= 0.98", f"{x:.3f}",
                          "met" if x >= 0.98 else "not met")
            self.goal("cold start to /health, vsup around vLLM - bare vLLM <= +1 s", f"{s['health_extra_s']:+.1f} s",
                      "met" if s["health_extra_s"] <= 1 else "not met")
        else:
            why = w["detect"].get("why_not") or "smoke mode: detection only"
            self.add(f"- vsup around a stock vLLM: not measured ({why})")
        k = self.need("soak")
        if k is not None:
            r, kills = k["requests"], k["kills"]
            roles = ", ".join(f"{n} {role}" for role, n in sorted(Counter(x["role"] for x in kills).items()))
            sup = k["resources"]["growth"].get("supervisor", {})
            self.add(f"- soak (`soak.json`, {k['minutes']:g} min, {k['streams']} streams, DP=2): {len(kills)} kills -9 "
                     f"({roles}); requests with the fault-free text **{r.get('ok', 0)}**, with another text "
                     f"**{r.get('different', 0)}**, failed **{r.get('failed', 0)}** (goal 0), cut with a killed API "
                     f"server's connections {r.get('api_server_cut', 0)}; the supervisor's RSS "
                     f"{sup.get('rss_mb', float('nan')):.2f}x and fds {sup.get('fds', float('nan')):.2f}x from "
                     f"warm-up to the end (goal <= 1.1)")
            self.goal("soak: requests failed under kill -9 every 20-40 s = 0", str(r.get("failed", 0)),
                      "met" if not r.get("failed") and not r.get("different") else "not met")
        self.add("")
        if bars:
            self.figure("supervisor.png", "The supervisor's figures, each over its baseline",
                        lambda: _ratio_bars("The supervisor", "ratio, each against its baseline in the same run",
                                            [(b[0], b[1], f" ({b[2]})", "#4C72B0") for b in bars],
                                            row_height=0.5, xmin=2.0, headroom=1.6))

    def scaling(self) -> None:
        s = self.need("scaling")
        if s is not None:
            self.source("scaling")
            self.add(f"{s['streams']} concurrent streams of {s['output_tokens']} tokens through `vsup serve` on "
                     f"{s['device']} ({s['cpu_count']} CPUs{', %d GPUs' % s['gpus'] if s.get('gpus') else ''}), "
                     f"every configuration up at once and measured in turn, {s['rounds']} round(s).", "")
            for note in s.get("notes", []):
                self.add(f"- {note}")
            self.add("", "| configuration | workers | ready s | tokens/s | over TP=1 DP=1 | TTFT p50 ms | ITL p50 ms | ITL p99 ms |",
                     "|---|---|---|---|---|---|---|---|")
            for r in s["rows"]:
                self.add(f"| {r['label']} | {r['workers']} | {r.get('ready_s', float('nan')):.1f} | "
                         f"{r['tokens_per_s']:.1f} | **{r['over_tp1']:.2f}** | {_f(r['ttft_p50_ms'])} | "
                         f"{_f(r['itl_p50_ms'])} | {_f(r['itl_p99_ms'])} |")
            self.add("")
            rows = s["rows"]

            def draw():
                fig, ax = plt.subplots(figsize=(6, 3.6))
                bars = ax.bar(range(len(rows)), [r["over_tp1"] for r in rows], color="#4C72B0")
                ax.bar_label(bars, fmt="%.2f", fontsize=8)
                ax.axhline(1.0, color="black", lw=0.8)
                ax.set_xticks(range(len(rows)), [r["label"] for r in rows], fontsize=8)
                ax.set_ylabel("tokens/s over TP=1 DP=1's")
                ax.set_title(f"Scaling on {s['device']}, {s['streams']} streams ({s['cpu_count']} CPUs)")
                return fig

            self.figure("scaling.png", "Throughput of each parallel configuration over TP=1 DP=1, same run", draw)
        self.add(GPU_PARAGRAPH, "")

    def structured(self) -> None:
        s = self.need("structured")
        if s is None:
            return
        self.source("structured")
        c, r = s["compile"], s["ratio_50_over_0"]
        self.add(f"{s['streams']} concurrent streams of {s['output_tokens']} tokens through `vsup serve`, "
                 f"{s['rounds']} round(s): half of them under a JSON schema against none, tokens/s "
                 f"**{r:.2f}x**. A 50-field schema ({c['schema_bytes']} bytes) compiles in "
                 f"{c['compile_median_ms']:.1f} ms (median), after a one-off {c['setup_s']:.1f} s for the "
                 "tokenizer's info.", "")
        self.goal("50% structured vs 0% at 16 streams >= 0.9x", f"{r:.2f}x", "met" if r >= 0.9 else "not met")

    def peers(self) -> None:
        p = self.need("peers")
        if p is None:
            return
        self.source("peers")
        self.add(f"CPU: {p['conditions'].get('cpu_model', '?')}. {p['tokens']} tokens a stream; medians of "
                 f"{len(next(iter(p['rounds'].values()), []))} interleaved round(s); each side at its own defaults "
                 "(bench/peers.py names every flag).", "")
        for side, why in p.get("skipped", {}).items():
            self.add(f"- {side} skipped: {why}")
        counts = p["streams"]
        ours = [s for s in ("vsup", "vsup-f32") if s in p["sides"]]
        for placement, summary in p["summary"].items():
            self.add("", f"**{placement}** (every core for the model)" if placement == "all" else
                     f"**{placement}** (each side's own placement)", "",
                     "| side | " + " | ".join(f"{n} streams tok/s | TTFT p50, p99 ms | ITL p50, p99 ms" for n in counts)
                     + " | " + " | ".join(f"{o} / side" for o in ours) + " |",
                     "|---|" + "---|---|---|" * len(counts) + "---|" * len(ours))
            for side in p["sides"]:
                ratios = [", ".join(f"{summary[o][str(n)].get('x_' + side, float('nan')):.2f}x" for n in counts)
                          if side != o else "-" for o in ours]
                figures = ([summary[side][str(n)].get(k, float("nan")) for k in LATENCY_FIGURES] for n in counts)
                self.add(f"| {side} | " + " | ".join(f"{_f(tok)} | {_f(t50)}, {_f(t99)} | {_f(i50)}, {_f(i99)}"
                                                    for tok, t50, t99, i50, i99 in figures)
                         + "".join(f" | {r}" for r in ratios) + " |")
                if side not in ("vllm", "llama.cpp"):
                    continue
                for o in ours[:1]:  # (the goal is our default's)
                    for n in counts:
                        x = summary[o][str(n)].get(f"x_{side}")
                        goal = 1.4 if placement == "all" else 1.0
                        self.goal(f"{o} / {side}, {n} streams, {placement} >= {goal}x", f"{x:.2f}x",
                                  "met" if x >= goal else "not met")
        self.add("")

    def front(self) -> None:
        f = self.need("front_relay")
        if f is None:
            return
        self.source("front_relay")
        cap, lat = f["cases"]["capacity"], f["cases"]["latency"]
        self.add(f"vsup's front for a stock vLLM (`vsup serve --engine vllm`) on one core, a stand-in upstream that "
                 f"streams vLLM-shaped chunks with token ids to {f['streams']} streams: **{cap['front_tokens_per_s']:.0f} "
                 f"tokens/s** through the front as fast as the upstream goes (straight to it: "
                 f"{cap['straight_tokens_per_s']:.0f}); at {f['goals']['tokens_per_s']:,} tokens/s offered, ITL p99 "
                 f"{lat['front_itl_p99_ms']:.2f} ms through the front against {lat['straight_itl_p99_ms']:.2f} ms "
                 f"straight (+{f['itl_p99_added_ms']:.2f} ms).", "")
        self.goal(f"front relay on one core >= {f['goals']['tokens_per_s']:,} tokens/s",
                  f"{f['front_tokens_per_s']:.0f}", "met" if f["front_tokens_per_s"] >= f["goals"]["tokens_per_s"]
                  else "not met")
        self.goal(f"front's ITL p99 added <= {f['goals']['itl_p99_added_ms']} ms", f"{f['itl_p99_added_ms']:.2f} ms",
                  "met" if f["itl_p99_added_ms"] <= f["goals"]["itl_p99_added_ms"] else "not met")

    def goals_table(self) -> None:
        self.add("| goal | figure | status |", "|---|---|---|")
        for goal, figure, status in self.goals:
            self.add(f"| {goal} | {figure} | {status} |")
        self.add("")

    def missing_inputs(self) -> None:
        if not self.missing:
            self.add("None: every bench's results were there.", "")
        for name, what in dict.fromkeys(self.missing):
            self.add(f"- {name}: {what}")
        self.add("")

    def build(self) -> str:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.add("# vsup benchmark report", "",
                 f"Written {now} by `bench/report.py` from `{', '.join(f'{n}.json' for n in self.data)}`. "
                 "Every figure is a ratio of two things measured side by side in one run on the same machine "
                 "(see bench/README.md for what each bench does); absolute times are given for orientation only.", "")
        smoke = [n for n, d in self.data.items() if d.get("conditions", {}).get("mode") == "smoke"]
        if smoke:
            self.add(f"**Smoke results ({', '.join(smoke)}): these runs only check that each bench works; their "
                     "figures mean nothing.** Run `make bench-quick` or `make bench` for figures.", "")
        self.section("Conditions", self.conditions)
        self.section("Serving", self.serving)
        self.section("Against peers at their defaults", self.peers)
        self.section("The front's relay", self.front)
        self.section("Engine overhead", self.overhead)
        self.section("The seed's claim", self.claim)
        self.section("The supervisor", self.supervisor)
        self.section("Scaling", self.scaling)
        self.section("Structured outputs", self.structured)
        self.section("Against the goals", self.goals_table)
        self.section("Missing inputs", self.missing_inputs)
        text = "\n".join(self.lines).rstrip() + "\n"
        (self.dir / "REPORT.md").write_text(text)
        return text


def _ratio_bars(title: str, xlabel: str, bars: list[tuple[str, float, str, str]], *, row_height: float,
                xmin: float, headroom: float) -> plt.Figure:
    """One horizontal bar per (label, ratio, note, colour), a line at 1.0, the ratio written at each bar's end."""
    fig, ax = plt.subplots(figsize=(7.5, row_height * len(bars) + 1.2))
    ys = list(range(len(bars)))
    ax.barh(ys, [b[1] for b in bars], color=[b[3] for b in bars])
    for y, (_, value, note, _) in zip(ys, bars):
        ax.text(value, y, f" {value:.2f}{note}", va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(ys, [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(xmin, *(b[1] * headroom for b in bars)))
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    return fig


def _log_y(ax) -> None:
    """A log y axis labelled 0.5, 1, 2 rather than 5x10^-1."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    low, high = ax.get_ylim()
    # within about a decade, label the minor ticks too (else only "1" shows)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}") if high / low < 30 else NullFormatter())
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _load(c: dict) -> str:
    start, end = c.get("load_average_at_start"), c.get("load_average_at_end")
    return f"{start[0]:.2f} -> {end[0]:.2f}" if start and end else "?"


def _f(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1024 else f"{n} B"


def _meets(bar: tuple) -> bool:
    _, value, goal, direction = bar
    return goal is not None and (value <= goal if direction == "<=" else value >= goal)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", default=None, help=f"default: ${RESULTS_ENV} or bench/results")
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # the same flags as every bench
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    directory = Path(args.results_dir) if args.results_dir else results_dir()
    if not directory.is_dir():
        parser.error(f"no results directory {directory}: run the benches first (make bench-quick)")
    report = Report(directory)
    report.build()
    print(f"{directory / 'REPORT.md'}: {len(report.data)} of {len(BENCHES)} inputs, figures: "
          f"{', '.join(report.figures) or 'none'}" + (f"; missing: {', '.join(sorted({m[0] for m in report.missing}))}"
                                                      if report.missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
