"""`vsup ps` answering "why is it slow": what each process is busy with and the diagnosis, made true for
real (a tokenizer that cannot keep up, a KV cache too small), and `ps -w` refreshing the tree in place."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.served import VSUP, Streams
from tests.polling import wait_for
from vsup.diagnosis import BUSY_API_SERVER, IDLE_STEPS

REPO = Path(__file__).resolve().parents[2]


def diagnosis(s, starts: str):
    state = s.ps()
    return state and next((line for line in state.get("diagnosis", []) if line.startswith(starts)), None) and state


def test_a_tokenizer_that_cannot_keep_up_is_named_as_the_bottleneck(serve):
    """Three clients post long texts to /tokenize without pause while two streams decode, through one
    API server: tokenizing takes most of its time while the engine core mostly waits for work."""
    s = serve()
    s.wait_serving()
    text = "the quick brown fox jumps over the lazy dog " * 4000  # 180 KB a request
    stop = threading.Event()

    def post():
        with httpx.Client(base_url=s.url, timeout=60) as http:
            while not stop.is_set():
                assert http.post("/tokenize", json={"prompt": text}).status_code == 200

    clients = [threading.Thread(target=post) for _ in range(3)]
    for t in clients:
        t.start()
    streams = Streams(s.client, ["a story", "another story"], n=200)
    try:
        state = wait_for(lambda: diagnosis(s, "api-server a0 is the bottleneck"), timeout=60,
                         what="ps naming the API server as the bottleneck", now=lambda: s.vsup("ps").stdout)
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=60)
        streams.join()
    line = next(line for line in state["diagnosis"] if line.startswith("api-server a0"))
    assert "busy tokenising while engine-core dp0 steps" in line and line.endswith("add --api-server-count"), line
    server = next(p for p in state["processes"] if p["name"] == "api-server a0")
    core = next(p for p in state["processes"] if p["name"] == "engine-core dp0")
    busy = server["load"]["busy"]  # the rule's figures (on a loaded machine, tokenizing may be 77% of a busy loop)
    assert max(busy["loop"], busy["tokenize"]) >= BUSY_API_SERVER and busy["tokenize"] >= 0.5, state
    assert core["load"]["busy"].get("step", 0) < IDLE_STEPS, state
    assert "tokenizing" in s.vsup("ps").stdout  # the LOAD column says it too
    assert s.stop()[0] == 0


def test_a_full_kv_cache_with_requests_waiting_is_diagnosed(serve):
    """A KV cache of 1 MiB (1,024 tokens of the tiny model) under 48 long streams: the cache fills, the
    rest wait, and ps says to raise --kv-cache-memory. (Five streams fit at once: ten waves, several of
    the 2 s load reports even on a fast machine, where 24 streams could end between two of them.)"""
    s = serve(kv_cache_memory="1MiB")
    s.wait_serving()
    streams = Streams(s.client, [f"story {i}" for i in range(48)], n=200)
    try:
        state = wait_for(lambda: diagnosis(s, "KV cache full"), timeout=60, what="ps naming the full KV cache",
                         now=lambda: s.vsup("ps").stdout)
    finally:
        streams.join()
    line = next(line for line in state["diagnosis"] if line.startswith("KV cache full"))
    assert line.endswith("requests waiting: raise --kv-cache-memory"), line
    core = next(p for p in state["processes"] if p["name"] == "engine-core dp0")["load"]
    assert core["rates"]["kv_stalls"] > 0 and core["num_waiting"] > 0
    assert all(isinstance(t, str) for t in streams.texts())  # full, not failing: every stream completes
    assert s.stop()[0] == 0


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (the CI image has it)")
def test_ps_watch_redraws_the_tree_in_place_under_tmux(serve):
    """`vsup ps -w` in a real terminal (tmux): the screen holds one tree, and it changes as the
    deployment does (a stream starts: the worker's forward share and the core's running count move)."""
    s = serve("-tp", "2")
    s.wait_serving()
    session = f"vsup-ps-{s.port}"
    command = " ".join([*VSUP, "ps", "-w", "--interval", "0.5", "--name", s.name])
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "40",
                    f"env VSUP_HOME={s.home} {command}"], check=True)

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    try:
        idle = wait_for(lambda: (text := screen()) and "└── engine-core dp0" in text and text, timeout=30,
                        what="the tree on the screen")
        assert idle.count("supervisor (vsup serve)") == 1  # redrawn in place, not scrolled
        assert "├── worker dp0 pp0 tp0" in idle and "└── worker dp0 pp0 tp1" in idle
        streams = Streams(s.client, [f"story {i}" for i in range(4)], n=200)
        busy = wait_for(lambda: (text := screen()) != idle and "4 running" in text and text, timeout=30,
                        what="the screen showing the streams")
        streams.join()
        assert busy.count("supervisor (vsup serve)") == 1
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        time.sleep(0.2)
    assert s.stop()[0] == 0


def test_the_grafana_dashboard_queries_what_a_real_scrape_has(serve):
    """vsup/grafana/vsup-dashboard.json: every metric its panels query, and every label they group by, is
    in a real /metrics scrape of a DP=2 deployment that served requests."""
    dashboard = json.loads((REPO / "vsup" / "grafana" / "vsup-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 12
    s = serve("-dp", "2")
    s.wait_serving()
    assert Streams(s.client, [f"story {i}" for i in range(4)], n=16).texts()

    def scrape() -> dict[str, set[str]]:
        """Every metric of one scrape, with its labels: either of the two API servers (they share the port)
        answers it with what both counted."""
        labels: dict[str, set[str]] = {}
        for line in httpx.get(f"{s.url}/metrics", timeout=30, headers={"Connection": "close"}).text.splitlines():
            if line and not line.startswith("#"):
                name, _, rest = line.partition("{")
                labels.setdefault(name.split(" ")[0], set()).update(
                    re.findall(r'(\w+)="', rest.partition("}")[0]) if rest else ())
        return labels
    # what the processes are busy with reaches /metrics with their first load reports (every 2 s)
    wanted = {"vsup_process_busy_ratio", "vsup_process_events_per_second"} | {
        m for expr in exprs for m in re.findall(r"\b(vsup_\w+)", expr)}
    found = wait_for(lambda: (m := scrape()) and wanted <= m.keys() and m, timeout=30,
                     what="every metric of the dashboard in /metrics")
    for expr in exprs:
        for metric in re.findall(r"\b(vsup_\w+)", expr):
            assert metric in found, f"{metric} (in {expr}) is not in the scrape"
            for group in re.findall(r"by \(([\w, ]+)\)", expr):
                wanted = {g.strip() for g in group.split(",")} - {"le"}
                assert wanted <= found[metric] | {"le"}, (expr, found[metric])
    assert {"process", "role", "kind"} <= found["vsup_process_busy_ratio"]
    assert s.stop()[0] == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_each_process_runs_on_the_cpus_plan_gives_it_and_ps_shows_them(serve):
    """On 2 CPUs (taskset), the default placement keeps the second for the API server and the engine core
    (the API server at nice 5) and gives the first to the worker, every thread of it; --cpu-reserve 0
    gives the worker both. ps shows
    each process's CPU set, as plan predicted it on the same CPUs."""
    from vsup.cpulist import cpu_list

    first, second = sorted(os.sched_getaffinity(0))[:2]
    both = cpu_list([first, second])
    taskset = ("taskset", "-c", both)
    for flags, planned, expected in (
            ((), {"api-server a0": f"{second} (shared, nice 5)", "engine-core dp0": f"{second} (shared)",
                  "worker dp0 pp0 tp0": f"{first}"},
             {"api-server a0": [second], "engine-core dp0": [second], "worker dp0 pp0 tp0": [first]}),
            (("--cpu-reserve", "0"), {"api-server a0": "any", "engine-core dp0": "any", "worker dp0 pp0 tp0": both},
             {"api-server a0": [first, second], "engine-core dp0": [first, second],
              "worker dp0 pp0 tp0": [first, second]})):
        plan = subprocess.run([*taskset, *VSUP, "plan", "--device", "cpu", *flags], capture_output=True, text=True,
                              check=True).stdout
        for name, cpus in planned.items():
            assert re.search(rf"{name}\s+\S+\s+cpus {re.escape(cpus)}\s", plan), plan
        s = serve(*flags, prefix=taskset)
        state = s.wait_serving()
        assert {p["name"]: p["cpus"] for p in state["processes"]} == expected
        api_server = next(p for p in state["processes"] if p["role"] == "api-server")
        assert os.getpriority(os.PRIO_PROCESS, api_server["pid"]) == (0 if flags else 5)  # the core wins their CPU
        worker = next(p for p in state["processes"] if p["role"] == "worker")
        threads = os.listdir(f"/proc/{worker['pid']}/task")
        assert len(threads) > 1 and all(sorted(os.sched_getaffinity(int(t))) == expected[worker["name"]]
                                        for t in threads)  # torch's threads too
        logged = [json.loads(line) for line in s.vsup("logs", "--role", "worker", "--json").stdout.splitlines()]
        starting = [r for r in logged if r.get("event") == "starting"][-1]  # (setproctitle reuses /proc/PID/environ)
        assert starting["threads"] == len(expected[worker["name"]]) and starting["cores"] == expected[worker["name"]]
        table = s.vsup("ps", "--flat").stdout
        assert re.search(rf"worker dp0 pp0 tp0\s.*\s{cpu_list(expected[worker['name']])}\s", table), table
        assert s.stop()[0] == 0
