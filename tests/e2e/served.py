"""`vsup serve` as the e2e tests run it: a subprocess in its own VSUP_HOME, asked with `vsup ps`,
talked to with the official openai client; and the requests they send."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref

import httpx
import openai

from tests.local_deployment import free_port
from tests.polling import wait_for

VSUP = [sys.executable, "-m", "vsup"]
LOG_FIELDS = {"ts", "name", "event", "role", "a", "dp", "pp", "tp", "pid", "stream", "logger", "level"}


# float32 throughout, whatever the CPU: the tests hold a stream that a fault made recompute or resume to its
# fault-free greedy text, and count on what 4 MiB of KV cache holds (the default's bfloat16 parts, on a CPU that
# computes them, round a row differently as the rows beside it change: docs/operating.md)
FLOAT32 = ("--dtype", "float32")


class Served:
    """One `vsup serve` subprocess serving the model as "tiny".

    Its stdout is read only at the end, on purpose: a console nobody reads
    (a full pipe) must not stall the supervisor, and the chaos test fills it."""

    instances: weakref.WeakSet[Served] = weakref.WeakSet()  # a failed test shows their logs (conftest.py)

    def __init__(self, home, model, *flags, name="e2e", kv_cache_memory="4MiB", env=None, host="127.0.0.1",
                 prefix=()):
        """`host`: where its API server listens and the client reaches it; `prefix`: what runs the command
        (`ip netns exec NS` for a node in a network namespace of its own: it execs, so `proc` is still
        the supervisor)."""
        self.home, self.name, self.port = str(home), name, free_port()
        self.url = f"http://{host}:{self.port}"
        self.env = {**os.environ, "VSUP_HOME": self.home, **(env or {})}
        self.proc = subprocess.Popen([*prefix, *VSUP, "serve", model, "--name", name, "--host", host,
                                      "--port", str(self.port), "--device", "cpu", *FLOAT32,
                                      "--kv-cache-memory", kv_cache_memory,
                                      "--max-model-len", "256", "--served-model-name", "tiny", "--log-format", "json",
                                      *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)
        Served.instances.add(self)

    def vsup(self, *args):
        return subprocess.run([*VSUP, *args, "--name", self.name], capture_output=True, text=True, timeout=60,
                              env=self.env)

    def ps(self):
        result = self.vsup("ps", "--json")
        return json.loads(result.stdout) if result.returncode == 0 else None

    def wait_serving(self, timeout=180):
        """ps once every process of this node is ready (a head node also lists other nodes' as remote), from
        a live supervisor: a new one of the same name starts where its killed predecessor's state.json
        still says "serving", with that one's pids."""
        return wait_every_process_ready(self.proc, self.ps, timeout, "serving with every process ready")

    def last_log_lines(self, n=60) -> str:
        """The last `n` lines of `vsup logs`, each with its time (to read a failure's timeline)."""
        result = self.vsup("logs", "-n", str(n), "--json")
        lines = []
        for line in result.stdout.splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                lines.append(line)
                continue
            extra = " ".join(f"{k}={v}" for k, v in d.items() if k not in LOG_FIELDS and v is not None)
            lines.append(f"{d.get('ts', '')[11:23]} {d.get('name', ''):20} | {d.get('event', '')} {extra}")
        return "\n".join(lines) + result.stderr

    def pids(self):
        return {p["name"]: p["pid"] for p in self.ps()["processes"]}

    def counters(self) -> dict[int, tuple[int, int, int]]:
        """Each DP rank's (steps, dummy steps, requests) as /metrics shows them (DP > 1)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        found: dict[int, dict[str, int]] = {}
        for name, rank, value in re.findall(
                r'^vsup_engine_(steps|dummy_steps|requests)_total\{dp_rank="(\d+)"\} (\S+)$', text, re.M):
            found.setdefault(int(rank), {})[name] = int(float(value))
        return {r: (c.get("steps", 0), c.get("dummy_steps", 0), c.get("requests", 0)) for r, c in found.items()}

    def settled_counters(self, timeout=10.0) -> dict[int, tuple[int, int, int]]:
        """The counters once they stopped moving (cores report at once when idle, the coordinator
        publishes within 100 ms)."""
        last, deadline = None, time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = self.counters()
            if now and now == last:
                return now
            last = now
            time.sleep(0.4)
        return last

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, out, err

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def wait_every_process_ready(proc, ps, timeout: float, what: str) -> dict:
    """ps (`ps()`) once the supervisor `proc` serves and every process of this node is ready (other nodes'
    are listed as remote), from a live supervisor."""
    def serving():
        assert proc.poll() is None, proc.stderr.read()
        state = ps()
        ready = state and state["supervisor"]["live"] and state["supervisor"]["state"] == "serving" and all(
            p["state"] == "ready" for p in state["processes"] if not p["state"].startswith("remote"))
        return state if ready else None
    return wait_for(serving, timeout, what, interval=0.2, now=ps)


def kill_until_it_gives_up(s: Served, name: str, timeout: float) -> tuple[int, str, str, list[int]]:
    """kill -9 of process `name` each time ps shows it ready again, until `vsup serve` gives up; (exit code,
    stdout, stderr, the pids killed)."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while s.proc.poll() is None and time.monotonic() < deadline:
        state = s.ps()
        row = next((p for p in state["processes"] if p["name"] == name), None) if state else None
        if row and row["pid"] and row["state"] == "ready" and row["pid"] not in killed:
            os.kill(row["pid"], signal.SIGKILL)
            killed.append(row["pid"])
        time.sleep(0.1)
    out, err = s.proc.communicate(timeout=120)
    return s.proc.returncode, out, err, killed


def assert_gave_up(err: str, first_line: str) -> None:
    """What `vsup serve` says when a unit gives up: the unit and why, then up to 10 indented lines of its
    last stderr (or that there was none), and no traceback."""
    lines = err.splitlines()
    assert lines and lines[0] == f"vsup serve: {first_line}", err
    assert 1 <= len(lines) - 1 <= 10 and all(line.startswith("    ") for line in lines[1:]), err
    assert "Traceback" not in err


def complete(client, prompt, n=24, stream=True):
    """Greedy, ignore_eos: the same prompt gives the same text on every healthy deployment."""
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    text = ""
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
    return text


def complete_all(client, prompts, n=24, during=None):
    """Every prompt at once, as Streams; `during(streams)` runs while they do (say, a kill -9). Each
    prompt's whole text; AssertionError naming any stream that failed."""
    streams = Streams(client, prompts, n=n)
    if during:
        during(streams)
    return streams.texts(timeout=300)


def mid_stream(streams, what, after=None):
    """Wait until every stream has text, or half of them run (the client's own threads may start the last
    ones late, and a tiny model's first streams end within a second or two); given `after` (what an
    earlier call returned), until a stream that ran then has streamed more since and still runs: the
    deployment got on after the earlier fault. Then AssertionError unless some stream is still running,
    so that the fault hits work in flight. Returns the running streams' chunk counts of this moment."""
    def ready():
        if after is not None:
            return any(len(streams.chunks[i]) > a and not streams.finished[i] for i, a in after.items()) or \
                all(streams.finished[i] for i in after)
        return all(streams.chunks) or len(streams.running()) >= max(1, len(streams.chunks) // 2)
    wait_for(ready, timeout=120, what=f"streams under way before {what}", interval=0.02)
    running = {i: len(streams.chunks[i]) for i in streams.running()}
    assert running, f"every stream had finished before {what}"
    return running


class Streams:
    """Greedy streams at once (a thread each), watched chunk by chunk: a fault test waits until every one
    has streamed text, injects its fault while they run, then reads what they made."""

    def __init__(self, client, prompts, n=24):
        self.n = n
        self.chunks: list[list[str]] = [[] for _ in prompts]
        self.finished = [False] * len(prompts)
        self.ends: list[tuple[str | None, int | None]] = [(None, None)] * len(prompts)  # finish_reason, tokens
        self.errors: dict[int, str] = {}
        self.threads = [threading.Thread(target=self._run, args=(client, i, prompt, n), daemon=True)
                        for i, prompt in enumerate(prompts)]
        # every thread sends at once: started one by one, the last of 64 began up to 6 s late, behind the
        # GIL held by the first ones' streaming, and a tiny model's first streams were done by then
        self._go = threading.Barrier(len(prompts) + 1)
        for t in self.threads:
            t.start()
        self._go.wait(timeout=60)

    def _run(self, client, i, prompt, n):
        try:
            self._go.wait(timeout=60)
            for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text:
                    self.chunks[i].append(chunk.choices[0].text)
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.ends[i] = (chunk.choices[0].finish_reason, self.ends[i][1])
                if chunk.usage:
                    self.ends[i] = (self.ends[i][0], chunk.usage.completion_tokens)
        except Exception as e:  # the test reports it
            self.errors[i] = f"{type(e).__name__}: {e}"
        finally:
            self.finished[i] = True

    def all_streaming(self) -> bool:
        """Every stream has streamed text (some may have finished)."""
        return all(self.chunks)

    def running(self) -> list[int]:
        """The streams that have streamed text and not finished: work in flight."""
        return [i for i, chunks in enumerate(self.chunks) if chunks and not self.finished[i]]

    def join(self, timeout=120) -> None:
        """Wait until every stream has ended; AssertionError naming those still running after `timeout`."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        assert all(self.finished), f"streams still running after {timeout} s: {self.running()}"

    def texts(self, timeout=120) -> list[str]:
        """Each stream's whole text, once all ended; AssertionError naming any that failed, or that ended
        short of its n tokens without an error (say, a resubmission gone wrong)."""
        self.join(timeout)
        assert not self.errors, self.errors
        short = {i: end for i, end in enumerate(self.ends) if end != ("length", self.n)}
        assert not short, f"streams that ended short of {self.n} tokens (finish_reason, tokens): {short}"
        return ["".join(chunks) for chunks in self.chunks]
