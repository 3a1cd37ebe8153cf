"""What every role's argv shares: the parser itself and the parallel sizes.

Each role reads only its own flags (`parse_known_args`) from the argv vsup
gives it; abbreviations are off so that another role's flag can never pass
for a prefix of one of ours.
"""

from __future__ import annotations

import argparse


def role_parser(module: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"python -m {module}", description=description, allow_abbrev=False)


def add_parallel_sizes(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
