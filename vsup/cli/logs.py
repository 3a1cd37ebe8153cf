"""`vsup logs`: the tagged lines of a deployment, filtered by role, ranks, level and time."""

from __future__ import annotations

import json
import sys

import typer

from vsup.cli import options as o
from vsup.errors import UsageError

app = typer.Typer()


@app.command()
def logs(
    name: o.Name = "default",
    role: str = typer.Option(None, "--role", help="api-server, engine-core, worker, coordinator or supervisor."),
    dp: int = typer.Option(None, "--dp", help="Only this data-parallel rank."),
    pp: int = typer.Option(None, "--pp", help="Only this pipeline stage."),
    tp: int = typer.Option(None, "--tp", help="Only this tensor-parallel rank."),
    level: str = typer.Option(None, "--level", help="This level and above: debug, info, warning, error."),
    since: str = typer.Option(None, "--since", help="Lines from the last 30s, 10m, 2h, 1d, or since an ISO time."),
    lines: int = typer.Option(None, "-n", "--lines", help="Only the last N matching lines."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines as they come."),
    as_json: o.Json = False,
) -> None:
    """Print the deployment's log (logs/vsup.jsonl in its run dir), every line tagged with who wrote it."""
    from vsup.log_query import make_filter, parse_since, read_records, tail
    from vsup.rundir import RunDir
    from vsup.supervisor.log_format import render

    from vsup.log_query import LEVELS

    if level is not None and level not in LEVELS:
        raise UsageError(f"--level must be one of {', '.join(LEVELS)} (got {level!r})")
    if lines is not None and lines < 0:
        raise UsageError(f"-n/--lines must be at least 0 (got {lines})")
    run_dir = RunDir(name).require()
    match = make_filter(role, dp, pp, tp, level, parse_since(since) if since else None)
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
