"""The README's tour, run for real: `vsup serve` of the default model on two CPUs, then each command of the
README's `console` and `sh` blocks in order, beside it. tests/e2e/test_readme.py compares what each printed
with the README, masking only what changes from run to run (`mask`); this module rewrites the README's
outputs from a run:

    .venv/bin/python -m tests.e2e.tour --write     # then read the diff of README.md
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.local_deployment import free_port
from tests.polling import wait_for

README = Path(__file__).parents[2] / "README.md"
BIN = str(Path(sys.executable).parent)
BLOCK = re.compile(r"```(console|sh)\n(.*?)```", flags=re.S)
PS_MASKED = {"PID", "UPTIME", "CPU%", "RSS", "LOAD"}  # the ps columns that change from run to run
MASKS = [  # (what changes from run to run, what stands for it)
    (re.compile(r"\(supervisor pid \d+, up [\dhms]+\)"), "(supervisor pid N, up T)"),
    (re.compile(r"\(supervisor pid \d+\)"), "(supervisor pid N)"),
    (re.compile(r"server process \[\d+\]"), "server process [N]"),
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:PORT"),
    (re.compile(r"\b(port|seconds|rss_bytes|epoch|address)=\S+"), r"\1=*"),
    (re.compile(r"^kill -9 \d+$"), "kill -9 PID"),
    (re.compile(r" at \d\d:\d\d:\d\d UTC"), " at T UTC"),  # (ps's last incident)
    (re.compile(r"\bid=\d+"), "id=N"),
]

# What the CPU's default precision decides (vsup/memory.py's cpu_auto_parts: bfloat16 linears and KV cache where
# the CPU computes bfloat16): the dtypes and what they size. Masked only on a CPU whose default differs from
# the one the README's tour was written on, so that on the same kind of CPU a wrong figure still fails.
PRECISION_MASKED = {"DEV MEM"}
PRECISION_MASK = re.compile(r"\b(linear_dtype|kv_cache_dtype|weight_bytes|num_blocks|kv_bytes_per_block|"
                            r"kv_cache_bytes)=\S+")


def written_in_bfloat16(readme: str) -> bool:
    """Whether the README's tour was written on a CPU whose default is bfloat16 linears (its worker says so)."""
    return "linear_dtype=bfloat16" in readme


@dataclass
class Example:
    command: str
    output: str


def tour_section(text: str) -> tuple[str, str, str]:
    """The README before its tour, the tour (from `## A tour` to the next section), and after."""
    start = text.index("\n## A tour\n")
    end = text.index("\n## ", start + 1)
    return text[:start], text[start:end], text[end:]


def two_cpus() -> str:
    """The README's examples are of a 2-CPU host: plan's and ps's CPUS columns depend on the CPUs."""
    return ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))


def readme_examples(tour: str) -> list[tuple[str, list[Example]]]:
    """Each block of the tour in order: ("console", its `$ command` and output pairs), or ("sh",
    its commands, one Example each, with no output shown)."""
    out = []
    for kind, body in BLOCK.findall(tour):
        if kind == "console":
            chunks = body.split("$ ")[1:]
            out.append((kind, [Example(*(c.rstrip("\n").split("\n", 1) + [""])[:2]) for c in chunks]))
        else:
            joined = re.sub(r"\\\n\s*", " ", body)
            commands, current = [], []
            for line in joined.split("\n"):  # a `python -c "...` runs on to its closing quote
                current.append(line)
                if "\n".join(current).count('"') % 2 == 0:
                    commands.append("\n".join(current))
                    current = []
            out.append((kind, [Example(c.split("  #")[0].strip(), "") for c in commands if c.strip()]))
    return out


def mask(text: str, precision: bool = False) -> list[str]:
    """The lines of `text` with what changes from run to run masked, and runs of spaces as one (a masked
    cell's width changes the columns); `precision`: what the CPU's default precision decides too."""
    masked = PS_MASKED | (PRECISION_MASKED if precision else set())
    lines, columns = [], None
    for line in text.rstrip("\n").split("\n"):
        if line.startswith("NAME ") and "PID" in line:
            columns = re.split(r"\s{2,}", line.strip())
        elif columns and line.strip():
            cells = re.split(r"\s{2,}", line.strip())
            if len(cells) == len(columns):
                line = "  ".join("*" if name in masked else cell for name, cell in zip(columns, cells))
        else:
            columns = None
        for pattern, stands in MASKS + ([(PRECISION_MASK, r"\1=*")] if precision else []):
            line = pattern.sub(stands, line)
        lines.append(" ".join(line.split()))
    return lines


def by_process(lines: list[str]) -> dict[str, list[str]]:
    """Console lines (`NAME | event`) by the process that wrote them: each process's lines come in its own
    order, while processes interleave as they run. The supervisor's `still starting` lines, which only a
    machine slower than usual prints (a process quiet for 5 s), are left out."""
    out: dict[str, list[str]] = {}
    for line in lines:
        name, _, said = line.partition(" | ")
        if not said.startswith("still starting "):
            out.setdefault(name.strip(), []).append(said)
    return out


def shell(command: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"taskset -c {two_cpus()} {command}"], capture_output=True, text=True,
                          timeout=120, env=env)


def run_tour(env: dict, tour: str, port: str) -> list[tuple[str, list[Example], list[subprocess.CompletedProcess]]]:
    """Serve on `port`, run every command of the tour, stop: each block with what each of its commands did (for
    `vsup serve`, its console up to `serving`)."""
    serve = subprocess.Popen(["bash", "-c", f"exec taskset -c {two_cpus()} vsup serve --port {port}"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    printed: list[str] = []
    done = []

    def serving():
        assert serve.poll() is None, "".join(printed) + serve.stdout.read()
        printed.append(serve.stdout.readline())
        return "| serving " in printed[-1]

    try:
        wait_for(serving, timeout=600, what="vsup serve serving (its --startup-timeout is 600 s)", interval=0)
        pids = {}
        for kind, examples in readme_examples(tour):
            results = []
            for example in examples:
                command = example.command.replace("8000", port)
                if command.startswith("vsup serve"):
                    results.append(subprocess.CompletedProcess(command, 0, "".join(printed), ""))
                    continue
                if command.startswith("kill -9 "):  # the README's pid of a process: this run's (or, the first
                    shown = int(command.split()[-1])  # time, the last process of the last ps: the worker)
                    command = f"kill -9 {pids.get(shown) or pids['last']}"
                result = shell(command, env)
                result.args = command
                results.append(result)
                if command.startswith("vsup ps"):
                    pids.update(readme_pids(example.output, result.stdout))
                    rows = [re.split(r"\s{2,}", line.strip()) for line in result.stdout.splitlines()]
                    pids["last"] = int([row for row in rows if len(row) > 1 and row[1].isdigit()][-1][1])
                if command.startswith("kill -9 "):
                    wait_for(lambda: healed(env), timeout=120, what="the killed process's unit back")
            done.append((kind, examples, results))
        serve.wait(timeout=60)  # `vsup stop` returned: the supervisor is on its way out
    finally:
        if serve.poll() is None:
            serve.terminate()
        serve.communicate(timeout=120)
    return done


def readme_pids(shown: str, printed: str) -> dict[int, int]:
    """The README's pid of each process in a ps table -> this run's pid of the same name."""
    def table(text):
        return {name.lstrip("├└─│ "): int(pid) for name, pid in
                (re.split(r"\s{2,}", line.strip())[:2] for line in text.splitlines()[2:] if "  " in line.strip())
                if pid.isdigit()}
    ours = table(printed)
    return {pid: ours[name] for name, pid in table(shown).items() if name in ours}


def healed(env: dict) -> bool:
    """Serving again, every process ready, and each has sent a load report since (LOAD and DEV MEM in ps)."""
    state = json.loads(shell("vsup ps --json", env).stdout)
    return state["supervisor"]["state"] == "serving" and any(p["restarts"] for p in state["processes"]) and \
        all(p["state"] == "ready" and p.get("load") for p in state["processes"])


def tour_env(home: str) -> dict:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("VSUP_")}, "VSUP_HOME": home,
            "PATH": f"{BIN}:{os.environ['PATH']}"}


def rewritten(text: str, done, port: str, home: str) -> str:
    """The README with each console block's outputs replaced by this run's (its port and home as a user's)."""
    blocks = iter(done)

    def block(match):
        kind, _, results = next(blocks)
        if kind != "console":
            return match.group(0)
        chunks = match.group(2).split("$ ")[1:]
        body = ""
        for chunk, result in zip(chunks, results):
            command = result.args if chunk.startswith("kill -9 ") else chunk.split("\n", 1)[0]
            output = (result.stdout + result.stderr).rstrip("\n").replace(f":{port}", ":8000")
            output = output.replace(f"port={port}", "port=8000").replace(home, "~/.local/state/vsup")
            body += f"$ {command}\n" + (output + "\n" if output else "")
        return f"```console\n{body}```"
    return BLOCK.sub(block, text)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    with tempfile.TemporaryDirectory() as home:
        before, tour, after = tour_section(README.read_text())
        port = str(free_port())
        README.write_text(before + rewritten(tour, run_tour(tour_env(home), tour, port), port, home) + after)
