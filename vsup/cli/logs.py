"""`vsup logs`: the tagged lines of a deployment, filtered by role, ranks, level and time."""

from __future__ import annotations

import json
import sys

import typer

from vsup.cli import options
from vsup.errors import UsageError

app = typer.Typer()


@app.command()
def logs(
    name: options.Name = "default",
    role: options.Role = None,
    dp: options.DpRank = None,
    pp: options.PpRank = None,
    tp: options.TpRank = None,
    replica: options.ReplicaIndex = None,
    level: options.Level = None,
    since: options.Since = None,
    lines: options.Lines = None,
    follow: options.Follow = False,
    as_json: options.Json = False,
) -> None:
    """Print the deployment's log (logs/vsup.jsonl in its run dir), every line tagged with who wrote it."""
    from vsup.cli import crash
    from vsup.log_query import make_filter, parse_since, read_records, tail
    from vsup.rundir import RunDir
    from vsup.supervisor.log_format import render

    from vsup.log_query import LEVELS

    if level is not None and level not in LEVELS:
        raise UsageError(f"--level must be one of {', '.join(LEVELS)} (got {level!r})")
    if lines is not None and lines < 0:
        raise UsageError(f"-n/--lines must be at least 0 (got {lines})")
    run_dir = RunDir(name).require()
    crash.remember(run_dir)
    match = make_filter(role, dp, pp, tp, level, parse_since(since) if since else None, replica)
    width = 22
    color = sys.stdout.isatty()

    def show(record: dict) -> None:
        typer.echo(json.dumps(record) if as_json else render(record, width, color))

    selected = [r for r in read_records(run_dir.log_file) if match(r)]
    for record in selected[-lines:] if lines is not None else selected:
        show(record)
    if follow:
        for record in tail(run_dir.log_file):
            if match(record):
                show(record)
