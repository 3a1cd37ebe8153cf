"""`vsup stop` and `vsup restart`: ask the running supervisor."""

from __future__ import annotations

import time

import typer

from vsup.cli import options
from vsup.errors import Failure, UsageError

app = typer.Typer()

@app.command()
def stop(name: options.Name = "default", timeout: options.StopWait = 120.0) -> None:
    """Stop gracefully: drain in-flight requests, then API servers, coordinator, engine cores, workers."""
    from vsup.cli import crash
    from vsup.rundir import RunDir
    from vsup.supervisor.control_client import request

    run_dir = RunDir(name).require()
    crash.remember(run_dir)
    try:
        answer = request(str(run_dir.control_socket), "stop")
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
def restart(role: options.Role = None, dp: options.DpRank = None, replica: options.ReplicaIndex = None,
            rolling: options.Rolling = False, now: options.Now = False, name: options.Name = "default") -> None:
    """Restart processes of a role with their whole unit (a worker restarts its group), each drained first.

    An API server stops taking connections, finishes its open requests within the --drain-timeout it
    was served with, and restarts; with several, one at a time, so the others serve throughout. An engine core (or a
    worker's group) finishes its running requests first; what waits goes on after the restart.
    --now restarts at once, the way a crash would (no request is lost then either: they are
    recomputed, but an API server's own connections drop).

    With --engine vllm a unit is a whole vLLM tree (of --replica); --rolling restarts every replica in turn,
    each drained first, losing no request and keeping the others serving.
    """
    from vsup.cli import crash
    from vsup.rundir import RunDir
    from vsup.supervisor.control_client import request
    from vsup.topology import COUNTED

    if rolling and role is not None:
        raise UsageError("--rolling restarts whole vLLM replicas: give it without --role (and --replica N for one)")
    if not rolling and role not in COUNTED:  # None too: --role is required
        raise UsageError(f"--role must be one of {', '.join(COUNTED)} (got {role!r}), or give --rolling")
    run_dir = RunDir(name).require()
    crash.remember(run_dir)
    if (rolling or replica is not None) and run_dir.read_state()["supervisor"].get("engine") != "vllm":
        raise UsageError(f"--rolling and --replica are for --engine vllm; {name!r} runs vsup's own engine")
    try:
        answer = request(str(run_dir.control_socket), "restart", role=role, dp=dp, replica=replica,
                         rolling=rolling, now=now)
    except OSError:
        raise Failure(f"deployment {name!r} is not running (nothing answers on {run_dir.control_socket}); start it "
                      f"with 'vsup serve --name {name}'") from None
    if not answer.get("ok"):
        if rolling:
            raise Failure(f"no rolling restart of {name!r} now: every replica must be serving, and no other rolling "
                          f"restart under way (see 'vsup ps --name {name}')")
        where = "".join(f" with --{k} {v}" for k, v in (("dp", dp), ("replica", replica)) if v is not None)
        raise Failure(f"no running {role}{where} in {name!r} (see 'vsup ps --name {name}')")
    typer.echo(f"{'rolling restart of' if rolling else 'restarting'} {', '.join(answer['units'])}")
