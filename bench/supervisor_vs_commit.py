"""The supervisor's restart and `vsup ps` figures of this tree against those of a commit, interleaved:

    python bench/supervisor_vs_commit.py REV [--rounds 5]

A git worktree of REV is made in a temporary directory. Each round runs `bench/supervisor.py --quick` once
in each tree, from that tree (so `python -m vsup` and the engine it starts are that tree's), the order
alternating; the table gives each figure's median over the rounds and the ratio this tree / REV. Both
sides use this venv's Python and packages, and the same CPU kernels (built from the same sources).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import conditions, print_table, write_results  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
FIGURES = {"kill -9 of the worker to the next token": ("serve", "kill9_worker_to_next_token_s"),
           "vsup ps": ("ps", "vsup_ps_s"),
           "cold start to /health": ("serve", "cold_start_to_health_s"),
           "supervisor CPU while idle": ("serve", "supervisor_idle_cpu_share")}


def run_once(tree: Path, out: Path) -> dict:
    subprocess.run([sys.executable, str(tree / "bench" / "supervisor.py"), "--quick", "--results-dir", str(out)],
                   cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "supervisor.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=HERE, check=True, capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="vsup-bench-rev-") as tmp:
        other = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(other), commit], cwd=HERE, check=True)
        try:
            found: dict[str, list[dict]] = {"this": [], commit: []}
            for i in range(args.rounds):
                sides = [("this", HERE), (commit, other)]
                for name, tree in sides if i % 2 == 0 else reversed(sides):
                    found[name].append(run_once(tree, Path(tmp) / f"{name}-{i}"))
                    print(f"round {i + 1}/{args.rounds}: {name} done", file=sys.stderr)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=HERE, check=False)
    medians = {name: {figure: statistics.median(r[part][key] for r in runs)
                      for figure, (part, key) in FIGURES.items()} for name, runs in found.items()}
    write_results("supervisor_vs_commit", {"conditions": conditions(), "commit": commit, "rounds": args.rounds,
                                           "medians": medians, "runs": found})
    rows = [[figure, f"{medians['this'][figure]:.3f}", f"{medians[commit][figure]:.3f}",
             f"{medians['this'][figure] / medians[commit][figure]:.2f}" if medians[commit][figure] else "-"]
            for figure in FIGURES]
    print_table(f"the supervisor, this tree against {commit} (medians of {args.rounds} interleaved rounds)",
                ["figure", "this tree", commit, "ratio"], rows)


if __name__ == "__main__":
    main()
