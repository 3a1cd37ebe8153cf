"""Write vsup's shell completion scripts into completions/: the scripts `vsup --show-completion` prints.

Each comes from the app itself (click's `_VSUP_COMPLETE=source_<shell>` request),
so the files change only when Typer's scripts or the program's name do; the
completions themselves are computed by `vsup` at each Tab press. `make
completions` runs this; tests/vsup/test_completions.py fails when the files are stale.

    python completions/generate.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = {"bash": "vsup.bash", "zsh": "_vsup", "fish": "vsup.fish"}


def script(shell: str) -> str:
    """The completion script for `shell`, as `vsup --show-completion <shell>` prints it (stripped, one newline)."""
    env = {**os.environ, "_VSUP_COMPLETE": f"source_{shell}"}
    result = subprocess.run([sys.executable, "-m", "vsup"], env=env, capture_output=True, text=True,
                            cwd=HERE.parent, timeout=60)
    if result.returncode != 0 or not result.stdout.strip():
        raise SystemExit(f"vsup gave no {shell} completion script (exit {result.returncode}): {result.stderr.strip()}")
    return result.stdout.strip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="directory to write into (default: completions/)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for shell, name in FILES.items():
        (args.out / name).write_text(script(shell))
        print(args.out / name)


if __name__ == "__main__":
    main()
