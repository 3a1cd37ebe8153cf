"""`vsup plan` start-up against `python -c "import typer"`, side by side in one run.

The two commands alternate, so machine noise hits both alike; the figure that
counts is the ratio of medians (goal: at most 1.3x).

    python bench/plan_latency.py [--runs 30] [--quick | --smoke]    # quick: 10 runs, smoke: 1
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from common import add_mode_args, conditions, mode, write_results

COMMANDS = {
    "vsup plan": [sys.executable, "-m", "vsup", "plan", "--device", "cpu", "-tp", "4"],
    "import typer": [sys.executable, "-c", "import typer"],
}


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    add_mode_args(parser)
    args = parser.parse_args(argv)
    run_mode = mode(args)
    if run_mode == "smoke":
        args.runs = 2
    elif args.quick:
        args.runs = 10
    results = {"conditions": conditions(), "runs": args.runs}
    for argv in COMMANDS.values():  # warm the file cache
        wall(argv)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, argv in COMMANDS.items():
            times[name].append(wall(argv))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:<14} median {median * 1000:6.1f} ms  p90 {statistics.quantiles(times[name], n=10)[-1] * 1000:6.1f} ms")
    print(f"ratio vsup plan / import typer: {medians['vsup plan'] / medians['import typer']:.2f}x (goal <= 1.3x)")
    results |= {"vsup_plan_s": medians["vsup plan"], "import_typer_s": medians["import typer"],
                "ratio": medians["vsup plan"] / medians["import typer"], "samples_s": times}
    write_results("plan_latency", results, run_mode)


if __name__ == "__main__":
    main()
