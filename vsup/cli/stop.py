"""`vsup stop` and `vsup restart`: ask the running supervisor."""

from __future__ import annotations

import time

import typer

from vsup.cli import options as o
from vsup.errors import UsageError

app = typer.Typer()

@app.command()
def stop(name: o.Name = "default", timeout: o.StopWait = 120.0) -> None:
    """Stop gracefully: drain in-flight requests, then API servers, coordinator, engine cores, workers."""
    from vsup.rundir import RunDir
    from vsup.supervisor.control import request

    run_dir = RunDir(name).require()
    try:
        answer = request(str(run_dir.control_socket), {"cmd": "stop"})
    except OSError:
        typer.echo(f"deployment {name!r} is not running")
        return
    deadline = time.monotonic() + timeout
    while supervisor_alive(answer.get("pid")) and time.monotonic() < deadline:
        time.sleep(0.1)
    if supervisor_alive(answer.get("pid")):
        typer.echo(f"deployment {name!r} (supervisor pid {answer.get('pid')}) is still stopping after {timeout:g} s",
                   err=True)
        raise typer.Exit(1)
    typer.echo(f"stopped {name} (supervisor pid {answer.get('pid')})")


def supervisor_alive(pid: int | None) -> bool:
    import psutil

    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@app.command()
def restart(role: o.Role = None, dp: o.DpRank = None, name: o.Name = "default") -> None:
    """Restart processes of a role the way a crash would: with their whole unit (a worker restarts its group)."""
    from vsup.rundir import RunDir
    from vsup.supervisor.control import request
    from vsup.topology import COUNTED

    if role not in COUNTED:  # None too: --role is required
        raise UsageError(f"--role must be one of {', '.join(COUNTED)} (got {role!r})")
    run_dir = RunDir(name).require()
    try:
        answer = request(str(run_dir.control_socket), {"cmd": "restart", "role": role, "dp": dp})
    except OSError:
        typer.echo(f"deployment {name!r} is not running", err=True)
        raise typer.Exit(1) from None
    if not answer.get("ok"):
        typer.echo(f"no running {role}{f' with --dp {dp}' if dp is not None else ''} in {name!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"restarting {', '.join(answer['units'])}")
