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


DEFAULT_MAX_GRAMMAR_BYTES = 64 << 10
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0


def add_structured_output_limits(p: argparse.ArgumentParser) -> None:
    """The limits on a structured request's grammar: the API server checks its size, the core its compile."""
    p.add_argument("--max-grammar-bytes", type=int, default=DEFAULT_MAX_GRAMMAR_BYTES,
                   help="the largest JSON schema, regex, choice list or grammar a request may send (400 above)")
    p.add_argument("--grammar-compile-timeout", type=float, default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
                   help="seconds a grammar may take to compile before its request gets a 400")
