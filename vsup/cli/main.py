"""The `vsup` command: one Typer app joined from one file per command."""

from __future__ import annotations

import sys

import typer

from vsup import __version__
from vsup.cli import logs, plan, ps, serve, stop
from vsup.errors import UsageError
from vsup.rundir import NoDeployment

try:  # typer vendors click from 0.20 on
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException

app = typer.Typer(
    name="vsup",
    help="Plan, launch, supervise and explain the process tree of an LLM server "
         "(API servers, engine cores, workers, coordinator).",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: readable at any width, greppable, no rich import
)
app.add_typer(plan.app)
app.add_typer(serve.app)
app.add_typer(ps.app)
app.add_typer(logs.app)
app.add_typer(stop.app)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vsup {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Plan, launch, supervise and explain the process tree of an LLM server."""


def run() -> None:
    """Console entry: mistakes become one line on stderr and exit status 2, never a traceback."""
    command = " ".join(["vsup", *[a for a in sys.argv[1:2] if not a.startswith("-")]])
    state: dict = {}  # --config leaves what it read here, so that an error can name the file that set the value
    try:
        code = app(prog_name="vsup", standalone_mode=False, obj=state)
    except (UsageError, NoDeployment) as e:
        message = state["config"].explain(str(e)) if "config" in state else str(e)
        typer.echo(f"{command}: error: {message}", err=True)
        sys.exit(e.exit_code)
    except ClickException as e:
        hint = f" (see '{command} --help')" if e.exit_code == 2 else ""
        typer.echo(f"{command}: error: {e.format_message()}{hint}", err=True)
        sys.exit(e.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    sys.exit(code or 0)
