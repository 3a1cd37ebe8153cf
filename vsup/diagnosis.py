"""What each process is busy with, in a word, and the one-line diagnoses `vsup ps` prints when one stands
out. Pure: functions over the processes of a ps snapshot, each with its last load report (engine/load.py).
"""

from __future__ import annotations

from vsup.roles import API_SERVER, COORDINATOR, ENGINE_CORE, WORKER

REPORT_S = 2.0  # how often a process reports (engine/load.py)
STALE_S = 3 * REPORT_S + 1.0  # a report older than this says nothing of now
GAUGES = ("num_requests", "num_running", "num_waiting", "kv_cache_usage", "weight_bytes", "kv_cache_bytes",
          "device_reserved_bytes", "lockstep")

BUSY_API_SERVER = 0.8   # an API server this busy cannot take more
IDLE_STEPS = 0.5        # while the engine cores step less than this share of the time
IDLE_RANK_WAITING = 8   # a rank with nothing to do while another has this many waiting


def load_figures(record: dict | None, pid: int, now: float) -> dict | None:
    """A process's last load report as ps shows it; None when there is none from this pid that is recent."""
    if record is None or record.get("pid") != pid or now - record.get("received_at", 0.0) > STALE_S:
        return None
    figures = {"window_s": record.get("window_s"), "busy": record.get("busy") or {},
               "rates": record.get("rates") or {}}
    return figures | {k: record[k] for k in GAUGES if record.get(k) is not None}


def summary(role: str, load: dict | None) -> str:
    """The LOAD column: `loop 97%, tokenizing 93%`, `steps 12%, 2 running, 14 waiting, KV 98%`."""
    if not load:
        return "-"
    busy, rates = load.get("busy", {}), load.get("rates", {})
    if role == API_SERVER:
        parts = [f"loop {pct(busy.get('loop', 0))}", f"tokenizing {pct(busy.get('tokenize', 0))}"]
        if "num_requests" in load:
            parts.append(f"{load['num_requests']} requests")
    elif role == ENGINE_CORE:
        parts = [f"steps {pct(busy.get('step', 0))}", f"{load.get('num_running', 0)} running",
                 f"{load.get('num_waiting', 0)} waiting"]
        if "kv_cache_usage" in load:
            parts.append(f"KV {pct(load['kv_cache_usage'])}")
    elif role == WORKER:
        parts = [f"forward {pct(busy.get('forward', 0))}"]
    elif role == COORDINATOR:
        parts = [f"{rates.get('waves', 0):.1f} waves/s"] if load.get("lockstep") else []
        parts.append(f"{rates.get('load_reports', 0):.1f} load reports/s")
    else:
        return "-"
    return ", ".join(parts)


def device_memory(load: dict | None) -> int | None:
    """What a worker holds on its device: what torch reserved on CUDA, else its weights and KV cache."""
    if not load:
        return None
    if "device_reserved_bytes" in load:
        return load["device_reserved_bytes"]
    if "weight_bytes" in load:
        return load["weight_bytes"] + load.get("kv_cache_bytes", 0)
    return None


def diagnose(processes: list[dict]) -> list[str]:
    """The diagnoses that stand out now, each with the figures behind it and the fix."""
    loaded = [p for p in processes if p.get("load")]
    servers = [p for p in loaded if p["role"] == API_SERVER]
    cores = [p for p in loaded if p["role"] == ENGINE_CORE]
    return [*api_server_bottleneck(servers, cores), *kv_cache_full(cores), *idle_rank(cores)]


def api_server_bottleneck(servers: list[dict], cores: list[dict]) -> list[str]:
    """An API server busy all the time while the engine cores mostly wait for work."""
    if not servers or not cores:
        return []
    core = max(cores, key=lambda p: p["load"]["busy"].get("step", 0.0))
    steps = core["load"]["busy"].get("step", 0.0)
    if steps >= IDLE_STEPS:
        return []
    out = []
    for server in servers:
        busy = server["load"]["busy"]
        loop, tokenizing = busy.get("loop", 0.0), busy.get("tokenize", 0.0)
        if max(loop, tokenizing) < BUSY_API_SERVER:
            continue
        what = f"{pct(tokenizing)} busy tokenising" if tokenizing >= loop / 2 else f"{pct(loop)} busy"
        out.append(f"{server['name']} is the bottleneck: {what} while {core['name']} steps {pct(steps)} of the "
                   f"time; add --api-server-count")
    return out


def kv_cache_full(cores: list[dict]) -> list[str]:
    """Requests waiting while steps wait for KV blocks (a waiting request that did not fit, or a
    preemption): the cache, not the batch limits, holds them back."""
    out = []
    for core in cores:
        load = core["load"]
        waiting, stalls = load.get("num_waiting", 0), load["rates"].get("kv_stalls", 0.0)
        if waiting > 0 and stalls > 0:
            where = f" on {core['name']}" if len(cores) > 1 else ""
            out.append(f"KV cache full{where} ({pct(load.get('kv_cache_usage', 0.0))}, {stalls:.1f} steps/s wait "
                       f"for blocks), {waiting} requests waiting: raise --kv-cache-memory")
    return out


def idle_rank(cores: list[dict]) -> list[str]:
    """A DP rank with nothing to do while another has a queue: the API servers route around it."""
    idle = [p for p in cores if not p["load"].get("num_running") and not p["load"].get("num_waiting")]
    queued = [p for p in cores if p["load"].get("num_waiting", 0) >= IDLE_RANK_WAITING]
    if not idle or not queued:
        return []
    busiest = max(queued, key=lambda p: p["load"]["num_waiting"])
    names = ", ".join(f"dp{p['dp']}" for p in idle)
    return [f"{names} idle while dp{busiest['dp']} has {busiest['load']['num_waiting']} waiting: the API "
            f"servers route by the coordinator's load figures; see `vsup logs --role coordinator`"]


def pct(share: float) -> str:
    return f"{round(100 * share)}%"
