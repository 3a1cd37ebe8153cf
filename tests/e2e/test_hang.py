"""A hang of our engine, made for real: a worker stopped with SIGSTOP while greedy streams run. Its engine
core has requests and steps no more; vsup notices within --hang-timeout (vsup/supervisor/engine_units.py:
the core's load reports carry its requests and its steps), keeps the evidence first (an incident with the
stacks of the stuck group: the stopped worker's say where it stood), then restarts the worker group; the
core keeps its requests, and every stream ends with the text of a fault-free run."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from datetime import datetime

import httpx

from tests.e2e.served import Streams, complete_all
from tests.polling import wait_for

HANG_TIMEOUT = 5
PROMPTS = [f"the {i} way" for i in range(4)]
N = 200  # tokens per stream: still running when the worker stops, a few seconds on


def test_a_stopped_worker_is_a_hang_whose_evidence_is_kept_and_no_request_fails(serve):
    s = serve("--hang-timeout", str(HANG_TIMEOUT), kv_cache_memory="8MiB")
    s.wait_serving()
    reference = complete_all(s.client, PROMPTS, n=N)
    worker = s.pids()["worker dp0 pp0 tp0"]
    streams = Streams(s.client, PROMPTS, n=N)
    wait_for(lambda: streams.all_streaming(), timeout=60, what="every stream streaming")
    healths = []

    def watch_health():  # what a load balancer sees, every 0.1 s, until the group serves again
        while not streams.finished[0] or len(healths) < 5:
            try:
                reply = httpx.get(f"{s.url}/health", timeout=5)
                healths.append((reply.status_code, reply.json().get("message")))
            except httpx.HTTPError as e:
                healths.append((0, repr(e)))
            time.sleep(0.1)
    watcher = threading.Thread(target=watch_health, daemon=True)
    in_flight = streams.running()  # (read just before the stop: the fault hits these)
    stopped_at = time.time()
    os.kill(worker, signal.SIGSTOP)
    watcher.start()
    try:
        assert in_flight, "the streams ended before the fault"
        found = wait_for(lambda: json.loads(s.vsup("incidents", "--json").stdout or "[]"), timeout=HANG_TIMEOUT + 30,
                         what="the hang's incident", now=lambda: "\n".join(
                             [s.vsup("ps").stdout] + [s.vsup("logs", "--role", role, "-n", "15").stdout
                                                      for role in ("supervisor", "engine-core")]))
    finally:
        try:
            os.kill(worker, signal.SIGCONT)  # (vsup has killed it: a stopped process takes SIGKILL too)
        except ProcessLookupError:
            pass
    assert streams.texts(timeout=120) == reference  # the core kept them: none failed, none changed
    watcher.join(timeout=30)
    assert (503, "dp0 hung") in healths and healths[-1] == (200, None), healths  # unready while it restarted
    hang = found[0]
    assert len(found) == 1 and (hang["unit"], hang["cause"]) == ("worker-group dp0", "hang"), found
    assert "and no step for" in hang["verdict"] and f"(--hang-timeout {HANG_TIMEOUT})" in hang["verdict"]
    noticed_s = datetime.fromisoformat(hang["at"].replace("Z", "+00:00")).timestamp() - stopped_at
    # the core reports every 2 s (its last steps may have come just before the stop) and vsup looks every
    # second: --hang-timeout from the last progress it saw, within a few seconds of the stop
    assert HANG_TIMEOUT - 2 <= noticed_s <= HANG_TIMEOUT + 6, noticed_s
    held = hang["requests"]  # as the core last reported them (every 2 s) before it hung: ids and tokens so far
    assert 1 <= len(held) <= len(PROMPTS) and all(r["id"].startswith("cmpl-") and 0 <= r["tokens"] < N
                                                  for r in held), held
    assert {r["fate"] for r in held} == {"kept by engine-core dp0, recomputed on the new worker group"}
    stack = hang["stacks"]["worker dp0 pp0 tp0"]
    assert f"Process {worker}:" in stack and "worker" in stack, stack  # where the stopped worker stood
    assert hang["stacks_s"] < 3.0
    state = s.wait_serving()
    assert {p["name"]: p["restarts"] for p in state["processes"]}["worker dp0 pp0 tp0"] == 1
    closed = json.loads(s.vsup("incidents", "--json").stdout)[0]
    assert closed["id"] == hang["id"] and 0 < closed["restart_s"] < 60
    # what followed, from the processes that ran at the hang: the core's loss of its group, inside this incident
    assert any(line.startswith("engine-core dp0: warning worker group lost") for line in closed["consequences"]), \
        closed["consequences"]
    print(f"hang to evidence {noticed_s:.1f} s, py-spy {hang['stacks_s']} s, then serving again in "
          f"{closed['restart_s']} s\n" + s.vsup("incidents").stdout + s.vsup("incidents", "show", hang["id"]).stdout)
    assert s.stop()[0] == 0
