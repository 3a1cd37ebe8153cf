"""The `vsup` command: one Typer app joined from one file per command."""

from __future__ import annotations

import importlib
import os
import sys

import typer

from vsup import __version__
from vsup.errors import Failure, UsageError

try:  # typer vendors click from 0.20 on
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException

# each command -> the module of vsup.cli that `vsup COMMAND` imports; with a --config file, plan and serve
# import each other's as well, since one file serves the two (config_file.py checks the other's keys). The
# modules a command does not need slow `vsup plan`'s start (bench/plan_latency.py measures it).
COMMANDS = {"plan": "plan", "serve": "serve", "ps": "ps", "logs": "logs", "stop": "stop", "restart": "stop",
            "incidents": "incidents"}
CONFIG_SIBLING = {"plan": "serve", "serve": "plan"}


def make_app(modules: list[str] | None = None) -> typer.Typer:
    """The `vsup` app with the commands of these modules (default: all of them)."""
    app = typer.Typer(
        name="vsup",
        help="Plan, launch, supervise and explain the process tree of an LLM server "
             "(API servers, engine cores, workers, coordinator).",
        no_args_is_help=True,
        add_completion=True,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,  # plain help: readable at any width, greppable, no rich import
    )
    for module in modules or dict.fromkeys(COMMANDS.values()):
        app.add_typer(importlib.import_module(f"vsup.cli.{module}").app)
    app.callback()(main)
    return app


def __getattr__(name: str):
    if name == "app":  # every command, for man/generate.py, completions and tests
        return make_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vsup {__version__}")
        raise typer.Exit()


def main(
    version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Plan, launch, supervise and explain the process tree of an LLM server."""


def execute(argv: list[str]) -> int:
    """`vsup ARGV` as the console runs it, to its exit status, never a traceback: a mistake is one line on
    stderr and 2, a failure one line and 1, and an unexpected exception one line naming the file that holds
    its traceback, and 1 (vsup/cli/crash.py). run() and the tests of bad input both come through here."""
    command = " ".join(["vsup", *[a for a in argv[:1] if a in COMMANDS]])
    state: dict = {}  # --config leaves what it read here, so that an error can name the file that set the value
    try:
        app = make_app(modules_for(argv))
        code = app(args=argv, prog_name="vsup", standalone_mode=False, obj=state)
    except (UsageError, Failure) as e:
        message = state["config"].explain(str(e)) if "config" in state else str(e)
        typer.echo(f"{command}: error: {one_line(message)}", err=True)
        return e.exit_code
    except ClickException as e:
        hint = f" (see '{command} --help')" if e.exit_code == 2 else ""
        typer.echo(f"{command}: error: {one_line(e.format_message())}{hint}", err=True)
        return e.exit_code
    except typer.Abort:
        typer.echo("aborted", err=True)
        return 130
    except Exception as e:
        from vsup.cli import crash

        typer.echo(crash.report(command, e, state.get(crash.LOG_DIR)), err=True)
        return 1
    return code or 0


def modules_for(argv: list[str]) -> list[str] | None:
    """The modules `vsup ARGV` needs: a command named first needs its own (and with a config file, its
    sibling's); help, completion and mistakes need them all (None)."""
    if not argv or argv[0] not in COMMANDS or "_VSUP_COMPLETE" in os.environ:
        return None
    with_config = os.environ.get("VSUP_CONFIG") or any(a == "--config" or a.startswith("--config=") for a in argv)
    sibling = CONFIG_SIBLING.get(argv[0]) if with_config else None
    return [COMMANDS[argv[0]], *([sibling] if sibling else [])]


def one_line(message: str) -> str:
    """A message that quotes what the user typed stays one line, whatever they typed."""
    return message.replace("\r", "\\r").replace("\n", "\\n")


def run() -> None:
    """Console entry: see execute()."""
    sys.exit(execute(sys.argv[1:]))
