"""Incidents as text: the list `vsup incidents` prints and one whole incident. Formatting only."""

from __future__ import annotations


def _when(at: str) -> str:
    return at[:19].replace("T", " ")


def _restart(incident: dict) -> str:
    if incident.get("gave_up"):
        return "gave up"
    seconds = incident.get("restart_s")
    return "-" if seconds is None else f"{seconds:.1f}s"


def render_list(incidents: list[dict]) -> str:
    """One line each, newest first."""
    rows = [("ID", "WHEN (UTC)", "UNIT", "PROCESS", "CAUSE", "RESTART", "LOST", "VERDICT")]
    for i in incidents:
        death = i.get("death") or {}
        held = i.get("requests") or []
        lost = f"{sum(r['fate'].startswith('failed') for r in held)} of {len(held)}" if held else "-"
        rows.append((i["id"], _when(i["at"]), i["unit"], death.get("process") or "-", i["cause"], _restart(i), lost,
                     i["verdict"] + (f" (+{len(i['consequences'])} after)" if i.get("consequences") else "")))
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(f"{str(v):<{w}}" for v, w in zip(r, widths)) + "  " + str(r[-1]) for r in rows)


def render_one(i: dict) -> str:
    death = i.get("death")
    lines = [f"incident {i['id']}: {i['unit']} went down at {_when(i['at'])} UTC",
             f"  cause    {i['cause']}: {i['verdict']}"]
    if death:
        sent = f", sent by vsup: {death['sent_by_vsup']}" if death.get("sent_by_vsup") else ", not sent by vsup"
        lines.append(f"  process  {death['process']} (pid {death['pid']}): {death['exit']}"
                     + (sent if death.get("signal") else ""))
        memory = death.get("memory") or {}
        figures = []
        if memory.get("cgroup_oom_kills", [None, None])[1] is not None:
            before, after = memory["cgroup_oom_kills"]
            figures.append(f"oom_kill of its cgroup {before} -> {after} ({memory.get('cgroup')})")
        if memory.get("machine_oom_kills", [None, None])[1] is not None:
            before, after = memory["machine_oom_kills"]
            figures.append(f"oom_kill of the machine {before} -> {after}")
        if memory.get("peak_rss_bytes") is not None:
            figures.append(f"peak RSS {memory['peak_rss_bytes'] / 2**20:.1f} MiB")
        if memory.get("pressure_avg10") is not None:
            figures.append(f"memory pressure {memory['pressure_avg10']:g}% (some, avg10)")
        if figures:
            lines.append("  memory   " + "; ".join(figures))
    elif i["why"] != i["verdict"]:
        lines.append(f"  why      {i['why']}")
    if i.get("survivors"):
        lines.append("  killed   " + ", ".join(f"{s['process']} (pid {s['pid']})" for s in i["survivors"])
                     + " (still running: vsup ended them, after their stacks below)")
    lines.append(f"  restart  {_restart(i)}" + (f": {i['gave_up']}" if i.get("gave_up") else ""))
    held = i.get("requests") or []
    if held:
        fates = sorted({r["fate"] for r in held})
        lines.append(f"  requests {len(held)} in flight ({sum(r['tokens'] for r in held)} tokens generated): "
                     + "; ".join(fates))
        lines += [f"    {r['id']}: {r['tokens']} tokens" for r in held[:10]] + \
            ([f"    ... {len(held) - 10} more (--json lists all)"] if len(held) > 10 else [])
    for process, said in (i.get("last_lines") or {}).items():
        if said:
            lines.append(f"last lines of {process}:")
            lines += [f"  {line}" for line in said]
    for process, text in (i.get("stacks") or {}).items():
        lines.append(f"stacks of {process} (py-spy, {i.get('stacks_s')} s for all):")
        lines += [f"  {line}" for line in text.rstrip().splitlines()]
    for dump in i.get("nccl_dumps") or []:
        lines.append(f"NCCL flight recorder dump: {dump['path']} ({dump['bytes']} bytes; read it with "
                     f"python -m torch.distributed.flight_recorder.fr_trace)")
    if i.get("consequences"):
        lines.append("what followed (consequences, not incidents of their own):")
        lines += [f"  {line}" for line in i["consequences"]]
    return "\n".join(lines)
