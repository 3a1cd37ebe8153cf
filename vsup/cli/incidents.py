"""`vsup incidents`: why each unit went down, as the supervisor kept it before the restart
(vsup/supervisor/incidents.py); read from the run dir, so also after the deployment stopped."""

from __future__ import annotations

import json

import typer

from vsup.cli import options

app = typer.Typer()
incidents_app = typer.Typer(name="incidents", invoke_without_command=True, no_args_is_help=False,
                            help="Why each unit went down: `vsup incidents` lists them, newest first; "
                                 "`vsup incidents show ID` prints one whole.")
app.add_typer(incidents_app)


@incidents_app.callback()
def incidents(ctx: typer.Context, name: options.Name = "default", as_json: options.Json = False) -> None:
    """List the incidents, newest first: when, the unit, the process that went first, the cause, how long
    the restart took, and the verdict."""
    if ctx.invoked_subcommand is not None:
        return
    from vsup.cli.incident_text import render_list
    from vsup.rundir import RunDir
    from vsup.supervisor import incident_store

    found = incident_store.load_all(RunDir(name).require().path)
    if as_json:
        typer.echo(json.dumps(found, indent=2))
    elif not found:
        typer.echo(f"no incidents in deployment {name!r}")
    else:
        typer.echo(render_list(found))


@incidents_app.command()
def show(incident_id: str = typer.Argument(..., metavar="ID", help="The incident's number, as the list shows it."),
         name: options.Name = "default", as_json: options.Json = False) -> None:
    """Print one incident whole: the death, the memory evidence, each process's last lines, what followed."""
    from vsup.cli.incident_text import render_one
    from vsup.errors import UsageError
    from vsup.rundir import RunDir
    from vsup.supervisor import incident_store

    run_dir = RunDir(name).require()
    found = incident_store.load(run_dir.path, incident_id)
    if found is None:
        kept = [i["id"] for i in incident_store.load_all(run_dir.path)]
        raise UsageError(f"no incident {incident_id!r} in deployment {name!r}"
                         + (f" (it keeps {', '.join(kept[-1:] + kept[:1])} to {kept[0]})" if kept else
                            " (it has none)") + ": `vsup incidents` lists them")
    typer.echo(json.dumps(found, indent=2) if as_json else render_one(found))
