"""A bounded soak of `vsup serve` (our engine, the default model, DP=2 with two API servers and a
coordinator): mixed streaming load while a random process of the tree is killed with kill -9 every
20-40 s (workers, engine cores, the coordinator, API servers). It reports:

- requests that failed (goal: 0), apart from those that only a killed API server's own connections
  carried: a stream cut within a few seconds of the kill of an API server, which no other process
  can take over (the client's TCP connection ends with it);
- greedy requests whose text is not the text of a fault-free run of the same prompt (goal: 0);
- RSS and open fds per role, and of the supervisor, after warm-up and at the end (goal: no growth
  beyond 10%; processes restarted in between are new ones, so the supervisor's line counts most).

    python bench/soak.py [--minutes 10] [--streams 8] [--seed 0] [--quick | --smoke]

--quick soaks for 2 minutes, --smoke for one kill (seconds; its figures mean nothing). It exits 1
when a request failed (an API server's own cut apart), a greedy text differed, or the stop was not clean.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from common import Children, add_mode_args, conditions, mode, print_table, vsup_serve, write_results  # noqa: E402

VICTIM_ROLES = ("worker", "engine-core", "coordinator", "api-server")
API_SERVER_CUT_S = 5.0  # a stream that fails this soon after an API server's kill was its connection's
PROMPTS = [f"Story {i}: once upon a time" for i in range(8)]
MODEL = "SmolLM2-135M-Instruct"


def ps(home: Path, name: str) -> dict | None:
    out = subprocess.run([sys.executable, "-m", "vsup", "ps", "--json", "--name", name], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "VSUP_HOME": str(home)})
    return json.loads(out.stdout) if out.returncode == 0 else None


def wait_serving(home: Path, name: str, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = ps(home, name)
        if state and state["supervisor"]["state"] == "serving" and all(
                p["state"] == "ready" for p in state["processes"]):
            return state
        time.sleep(0.5)
    raise TimeoutError(f"not serving within {timeout_s:.0f} s: {ps(home, name)}")


def complete(client, prompt: str, n: int) -> str:
    text = ""
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
    return text


def resources(state: dict) -> dict[str, dict]:
    """RSS (MB) and open fds of each role's processes together, and of the supervisor."""
    out: dict[str, dict] = {}
    procs = [("supervisor", state["supervisor"]["pid"]), *((p["role"], p["pid"]) for p in state["processes"])]
    for role, pid in procs:
        try:
            p = psutil.Process(pid)
            rss, fds = p.memory_info().rss / 2**20, p.num_fds()
        except (psutil.Error, TypeError):
            continue
        entry = out.setdefault(role, {"processes": 0, "rss_mb": 0.0, "fds": 0})
        entry["processes"] += 1
        entry["rss_mb"] += rss
        entry["fds"] += fds
    return out


class Load:
    """`streams` threads, each streaming greedy completions one after another until told to stop."""

    def __init__(self, client, reference: dict[str, str], streams: int, n: int, seed: int):
        self.client, self.reference, self.n = client, reference, n
        self.outcomes: list[dict] = []
        self.running = 0  # requests sent and not yet finished
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(random.Random(seed + i),), daemon=True)
                        for i in range(streams)]
        for t in self.threads:
            t.start()

    def _run(self, rng: random.Random) -> None:
        while not self.stopping.is_set():
            prompt = rng.choice(PROMPTS)
            start = time.monotonic()
            with self.lock:
                self.running += 1
            try:
                text = complete(self.client, prompt, self.n)
                outcome = {"ok": True, "same": text == self.reference[prompt]}
            except Exception as e:  # noqa: BLE001 - the outcome is what the soak reports
                outcome = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
            outcome.update(start=start, end=time.monotonic())
            with self.lock:
                self.outcomes.append(outcome)
                self.running -= 1

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=600)


def classify(outcomes: list[dict], kills: list[dict]) -> Counter:
    """ok (the fault-free text), different (a greedy text not the fault-free one), failed, and
    api_server_cut (failed within API_SERVER_CUT_S of an API server's kill, while it was running)."""
    counts: Counter = Counter()
    api_kills = [k["at"] for k in kills if k["role"] == "api-server"]
    for o in outcomes:
        if o["ok"]:
            counts["ok" if o["same"] else "different"] += 1
        elif any(o["start"] <= at <= o["end"] <= at + API_SERVER_CUT_S for at in api_kills):
            counts["api_server_cut"] += 1
        else:
            counts["failed"] += 1
    return counts


def when(outcome: dict, kills: list[dict]) -> dict:
    """A request that did not succeed: its class, and its start and end against the last kill before its end."""
    before = [k for k in kills if k["at"] <= outcome["end"]]
    cut = classify([outcome], kills)
    where = {"class": next(iter(cut))}
    if before:
        k = before[-1]
        where.update(last_kill=k["name"], start_s=round(outcome["start"] - k["at"], 2),
                     end_s=round(outcome["end"] - k["at"], 2))
    return where


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mode_args(parser)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to soak (default 10)")
    parser.add_argument("--streams", type=int, default=8, help="streams at once (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the choice of victims, gaps and prompts")
    args = parser.parse_args(argv)
    run_mode = mode(args)
    minutes = 0.0 if run_mode == "smoke" else 2.0 if run_mode == "quick" else args.minutes
    n = 8 if run_mode == "smoke" else 48
    streams = 2 if run_mode == "smoke" else args.streams
    rng = random.Random(args.seed)
    cond = conditions()

    import openai

    with tempfile.TemporaryDirectory(prefix="vsup-soak-") as home, Children() as children:
        home, name = Path(home), "soak"
        server = vsup_serve(children, home, "-dp", "2", "--api-server-count", "2", "--max-restarts", "1000",
                            "--restart-max-delay", "2", name=name)
        server.wait_ready(timeout_s=300)
        wait_serving(home, name)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
        reference = {p: complete(client, p, n) for p in PROMPTS}  # fault-free, one at a time
        start_state = wait_serving(home, name)
        at_start = resources(start_state)
        load = Load(client, reference, streams, n, args.seed)
        kills: list[dict] = []
        began = time.monotonic()
        deadline = began + minutes * 60
        while True:
            gap = 3.0 if run_mode == "smoke" else rng.uniform(20, 40)
            if time.monotonic() + gap > deadline and kills:
                break
            time.sleep(gap)
            state = wait_serving(home, name)
            victims = [p for p in state["processes"] if p["role"] in VICTIM_ROLES and p["pid"]]
            victim = rng.choice(victims)
            os.kill(victim["pid"], signal.SIGKILL)
            kills.append({"at": time.monotonic(), "name": victim["name"], "role": victim["role"],
                          "requests_done_before": len(load.outcomes), "in_flight": load.running})
            print(f"{time.monotonic() - began:6.1f} s  kill -9 {victim['name']} (pid {victim['pid']}), "
                  f"{kills[-1]['in_flight']} requests in flight", flush=True)
        if run_mode != "smoke":
            time.sleep(max(0.0, deadline - time.monotonic()))
        load.stop()
        end_state = wait_serving(home, name)
        at_end = resources(end_state)
        code = server.stop(timeout_s=120)

    counts = classify(load.outcomes, kills)
    growth = {role: {k: (at_end[role][k] / at_start[role][k] if at_start[role][k] else float("nan"))
                     for k in ("rss_mb", "fds")} for role in at_start if role in at_end}
    print_table(f"soak: {minutes:g} min, {len(kills)} kills, {streams} streams, DP=2, 2 API servers",
                ["requests", "count"], [[k, counts.get(k, 0)] for k in ("ok", "different", "failed", "api_server_cut")])
    print_table("kills by role", ["role", "kills"], sorted(Counter(k["role"] for k in kills).items()))
    print_table("resources, after warm-up -> at the end", ["role", "procs", "RSS MB", "RSS end", "x", "fds",
                                                          "fds end", "x"],
                [[role, at_start[role]["processes"], at_start[role]["rss_mb"], at_end[role]["rss_mb"],
                  growth[role]["rss_mb"], at_start[role]["fds"], at_end[role]["fds"], growth[role]["fds"]]
                 for role in growth])
    failed = [{"error": o["error"], **when(o, kills)} for o in load.outcomes if not o["ok"]]
    for f in failed:
        if f["class"] == "failed":
            print(f"failed: {f}")
    write_results("soak", {"conditions": cond, "minutes": minutes, "streams": streams, "tokens": n,
                           "kills": kills, "requests": dict(counts),
                           "errors": sorted(failed, key=lambda f: f["class"] != "failed")[:20],
                           "resources": {"start": at_start, "end": at_end, "growth": growth},
                           "stop_exit_code": code}, run_mode)
    return 0 if code == 0 and not counts["failed"] and not counts["different"] else 1


if __name__ == "__main__":
    sys.exit(main())
