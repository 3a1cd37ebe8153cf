"""`vsup ps`: the live process tree, from the supervisor, or its last state when it is gone."""

from __future__ import annotations

import json
import sys
import time

import typer

from vsup.cli import options

app = typer.Typer()


@app.command()
def ps(name: options.Name = "default", replica: options.ReplicaIndex = None, as_json: options.Json = False,
       watch: options.Watch = False, interval: options.Interval = 2.0, flat: options.Flat = False) -> None:
    """Show the live process tree, as `vsup plan` draws it: each process's pid, state, uptime, restarts,
    last exit, CPU%, the CPUs it may run on (CPUS), RSS, device, device memory and what it is busy with
    (LOAD), then a one-line diagnosis when something stands out (an API server that is the bottleneck,
    a full KV cache, an idle DP rank).

    LOAD: an API server's event-loop busy share and time spent tokenizing; an engine core's share of
    time in steps, running and waiting requests and KV cache use; a worker's share of time in forward
    passes; the coordinator's waves per second. DEV MEM: what a worker holds on its device (on the CPU,
    its weights and KV cache).

    When the supervisor is gone, shows the last state it wrote (state.json) and says so; a process
    of the tree that is somehow still running is shown as orphaned.
    """
    from vsup.cli import crash
    from vsup.rundir import RunDir

    run_dir = RunDir(name).require()
    crash.remember(run_dir)
    if watch and not as_json:
        while True:  # like top: redraw in place until Ctrl-C
            screen = render(snapshot(run_dir, replica), flat)
            typer.echo("\x1b[H\x1b[2J" + screen if sys.stdout.isatty() else screen + "\n")
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                return
    state = snapshot(run_dir, replica)
    if as_json:
        typer.echo(json.dumps(state, indent=2))
    else:
        typer.echo(render(state, flat))


def snapshot(run_dir, replica: int | None = None) -> dict:
    """The live state from the supervisor, else the last one it wrote, with orphans marked; other
    nodes' processes (a head node's view) with their state as the API server sees it. With `replica`,
    only that vLLM replica's processes."""
    from vsup.supervisor.control_client import request

    try:
        state = request(str(run_dir.control_socket), "ps")
        state["supervisor"]["live"] = True
        add_remote(state)
    except (OSError, ValueError):
        state = run_dir.read_state()
        state["supervisor"]["live"] = False
        for p in state["processes"]:
            p["cpu_percent"] = p["rss_bytes"] = p["cpus"] = None
            if p.get("pid") is not None and still_running(p["pid"], p["title"]):
                p["state"] = "orphaned"  # outlived its supervisor: it may still hold memory
    if replica is not None:
        if not any(p.get("r") is not None for p in state["processes"]):
            from vsup.errors import UsageError
            raise UsageError(f"--replica {replica}: deployment {run_dir.name!r} has no replicas (vsup serve "
                             f"--engine vllm --replicas N)")
        state["processes"] = [p for p in state["processes"] if p.get("r") == replica]
    return state


def add_remote(state: dict) -> None:
    """Other nodes' processes join the list, each `remote: <state>` of its DP rank in the API server's /health
    (or, with a stock vLLM, as its node last told the head's vsup)."""
    remote = state.pop("remote", None) or []
    if not remote:
        return
    ranks = health_ranks(state["supervisor"]["url"])
    for p in remote:
        rank = ranks.get(str(p["dp"])) if ranks is not None else None
        state["processes"].append({**p, "pid": None, "restarts": rank["num_restarts"] if rank else 0,
                                   "state": p.get("state") or f"remote: {rank['state'] if rank else 'unknown'}",
                                   "host": rank.get("node") if rank else None})


def health_ranks(url: str) -> dict | None:
    """The DP ranks of the API server's /health, or None when it does not answer within a second."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=1.0) as response:
            return json.load(response).get("dp_ranks")
    except OSError as e:
        body = getattr(e, "read", None)  # a 503 still carries the ranks
        try:
            return json.loads(body()).get("dp_ranks") if body else None
        except (ValueError, OSError):
            return None
    except ValueError:
        return None


def still_running(pid: int, title: str) -> bool:
    """Whether `pid` is still the tree's process (its title), not a stranger who got the number."""
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline()).strip() == title
    except psutil.Error:
        return False


def render(state: dict, flat: bool = False) -> str:
    """The tree (as `plan` draws it) with each process's live columns, then the diagnoses; `flat`: one
    table row per process, without the load and device memory."""
    from vsup.diagnosis import device_memory, summary
    from vsup.sizes import format_bytes
    from vsup.printer import tree_rows

    sup = state["supervisor"]
    now = time.time()
    if sup["live"]:
        engine = " with vLLM" if sup.get("engine") == "vllm" else ""
        head = (f"{sup['name']}: {sup['state']} {sup['model']}{engine} on {sup['url']} "
                f"(supervisor pid {sup['pid']}, up {_duration(now - sup['started_at'])})")
    else:
        head = (f"{sup['name']}: supervisor not running; last state ({sup['state']}) "
                f"from state.json{': ' + sup['message'] if sup.get('message') else ''}")
    if flat:
        columns = ("NAME", *LIVE_COLUMNS)
        rows = [(p["name"], *_live(p, sup["live"], now)) for p in state["processes"]]
        return "\n".join([head, *_table(columns, rows)])
    columns = ("NAME", *LIVE_COLUMNS, "DEV MEM", "LOAD")
    root = ("supervisor (vsup serve)", str(sup["pid"]) if sup["live"] else "-", sup["state"],
            _duration(now - sup["started_at"]) if sup["live"] else "-", *["-"] * (len(columns) - 4))
    rows = [root]
    for prefix, p in tree_rows(state["processes"], role=lambda p: p["role"], group=lambda p: (p.get("r"), p["dp"])):
        memory = p.get("device_memory_bytes") or device_memory(p.get("load"))
        rows.append((prefix + p["name"], *_live(p, sup["live"], now),
                     format_bytes(memory) if memory else "-", summary(p["role"], p.get("load"))))
    lines = [head, *_table(columns, rows)]
    lines += state.get("diagnosis") or []
    lines += incident_lines(state)
    lines += [f"cuda:{o['gpu']} is also held by pid {o['pid']} ({o.get('cmdline') or '?'}): {format_bytes(o['bytes'])}"
              for o in state.get("gpu_others") or []]
    return "\n".join(lines)


def incident_lines(state: dict) -> list[str]:
    """Under the table: each unit's last incident, in short (vsup/supervisor/incidents.py)."""
    last = (state.get("incidents") or {}).get("last") or {}
    return [f"last incident of {unit}: {i['id']} at {(i.get('at') or '')[11:19]} UTC, {i['cause']}: {i['verdict']}"
            f" (vsup incidents show {i['id']})" for unit, i in sorted(last.items(), key=lambda kv: kv[1]["at"])]


LIVE_COLUMNS = ("PID", "STATE", "UPTIME", "RESTARTS", "LAST EXIT", "CPU%", "CPUS", "RSS", "DEVICE")


def _live(p: dict, live: bool, now: float) -> tuple[str, ...]:
    from vsup.sizes import format_bytes
    from vsup.cpulist import cpu_list

    alive = p.get("pid") is not None and live
    return (str(p.get("pid") or "-"), p["state"],
            _duration(now - p["started_at"]) if alive and p.get("started_at") else "-",
            str(p.get("restarts", 0)), p.get("last_exit") or "-",
            f"{p['cpu_percent']:.0f}" if p.get("cpu_percent") is not None else "-",
            cpu_list(p["cpus"]) if p.get("cpus") else "-",
            format_bytes(p["rss_bytes"]) if p.get("rss_bytes") else "-", p.get("device") or "-")


def _table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [columns, *rows]]


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
