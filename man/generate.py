"""Write man/vsup.1, the vsup(1) manual page, from the click command tree of the Typer app.

Commands, arguments, options, defaults and option variables come from the app,
so the page says what `--help` says; the prose (DESCRIPTION, the configuration
file, EXAMPLES, FILES, the variables read outside options, EXIT STATUS) is
written here. `make man` runs this; tests/vsup/test_man_page.py fails when the
page is stale or an example uses an option that does not exist.

    python man/generate.py [--out FILE]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent

DESCRIPTION = [
    "`vsup plan` prints the process tree a deployment will have, and `vsup serve` launches exactly that tree "
    "(both call the same function): the supervisor (`vsup serve` itself), the API servers (--api-server-count, "
    "default the DP size), one engine core per data-parallel rank, one worker per device (TP x PP per engine "
    "core) and, when DP > 1, a coordinator. Count = API servers + DP + DP x TP x PP (+ 1 when DP > 1): "
    "`vsup plan -tp 4` gives 1 + 1 + 4 = 6.",
    "Every process has one name everywhere (process title, log prefix, `vsup ps`, JSON): {api-server a0}, "
    "{engine-core dp0}, {worker dp0 pp0 tp1}, {coordinator}. The supervisor reads every child's stdout and "
    "stderr and tags each line with the role and ranks of the pipe it came from, so even a C library's message "
    "or a traceback says who wrote it; `vsup logs` filters them.",
    "A process that dies restarts with its unit: a worker with its whole worker group (the engine core keeps "
    "its queue and recomputes), an engine core with its worker group, the coordinator or an API server alone; "
    "with exponential backoff (0.5 s doubling to 30 s) and at most --max-restarts restarts in 300 s, after "
    "which the unit is marked failed and the API servers route around it.",
    "Every option that lists a variable under ENVIRONMENT can be set there too, and the options of `plan` and "
    "`serve` also in a --config file: a flag wins over the variable, the variable over the file, the file over "
    "the default.",
]

CONFIG_FILE = [
    "`--config` {FILE} (or `VSUP_CONFIG`) reads option values for `plan` and `serve` from a TOML ({.toml}) or "
    "YAML ({.yaml}, {.yml}) file; the extension picks the format. Keys are long option names, with dashes or "
    "underscores ({tensor-parallel-size} or {tensor_parallel_size}); {model} sets MODEL; boolean flags take "
    "true or false ({multiprocessing = false} is --no-multiprocessing); a relative MODEL path is taken from the "
    "current directory, as on the command line. One file serves both commands: `plan` "
    "checks, then skips, the keys only `serve` takes. An unknown key or a bad value is a usage error that "
    "names the key and the file.",
]
CONFIG_EXAMPLE = """\
# deploy.toml
model = "/srv/models/SmolLM2-135M-Instruct"
tensor-parallel-size = 3
device = "cpu"
port = 8001
restart-policy = "always"
"""

EXAMPLES = [
    ("Show the process tree of a tensor-parallel deployment before launching it:", ["vsup plan -tp 4"]),
    ("The same as JSON, with memory per worker for a local model:",
     ["vsup plan ./SmolLM2-135M-Instruct -tp 3 --device cpu --json"]),
    ("Serve the default model (SmolLM2-135M-Instruct, converted once into the cache) on port 8000:",
     ["vsup serve"]),
    ("Serve a local model on two GPUs under a name of its own:",
     ["vsup serve ./Qwen2-0.5B -tp 2 --port 8001 --name qwen"]),
    ("Serve what a configuration file describes, with one value overridden by a flag and one by a variable:",
     ["vsup serve --config deploy.toml --port 8002", "VSUP_MAX_NUM_SEQS=64 vsup serve --config deploy.toml"]),
    ("Ask the server:",
     ["curl http://127.0.0.1:8000/v1/completions \\",
      "    -H 'Content-Type: application/json' \\",
      "    -d '{\"model\": \"SmolLM2-135M-Instruct\",",
      "         \"prompt\": \"The capital of France is\", \"max_tokens\": 8}'"]),
    ("See every process, then the lines the workers wrote in the last ten minutes, and follow them:",
     ["vsup ps", "vsup logs --role worker --since 10m -f"]),
    ("Restart the worker group of DP rank 0 the way a crash would, then stop everything gracefully:",
     ["vsup restart --role worker --dp 0", "vsup stop"]),
    ("Two nodes, DP 4: the head node runs the API servers, the coordinator and DP ranks 0-1; "
     "the second node runs ranks 2-3 headless:",
     ["export VSUP_CLUSTER_SECRET=...   # the same on both nodes",
      "vsup serve -dp 4 --dp-size-local 2 --dp-address 10.0.0.1:29550",
      "vsup serve -dp 4 --dp-size-local 2 --dp-start-rank 2 --headless --dp-address 10.0.0.1:29550"]),
    ("One TP 4 group across two nodes: node 0 runs the API server, the engine core and tp0-tp1, node 1 tp2-tp3:",
     ["vsup serve -tp 4 --nnodes 2 --master-addr 10.0.0.1",
      "vsup serve -tp 4 --nnodes 2 --node-rank 1 --headless --master-addr 10.0.0.1"]),
]

EXIT_STATUS = [
    ("0", "Success; for `vsup serve` also a clean stop on SIGTERM, SIGINT or `vsup stop`."),
    ("1", "A runtime failure: `vsup serve` has nothing left to serve (every DP rank failed past its "
          "restart limit, or startup failed or timed out; the message names the unit and its last stderr "
          "lines); `vsup ps`, `logs`, `stop` or `restart` named an unknown deployment; "
          "`vsup restart` found nothing running to restart; `vsup stop` timed out. Or an internal error: one "
          "line names it and the file holding its traceback (a {crash-*.log} in the run dir's logs/, else a "
          "{vsup-*.log} temp file); VSUP_DEBUG=1 prints the traceback too."),
    ("2", "A usage error, found before anything starts: an unknown option or a bad value on the command line, "
          "in the environment or in a --config file (an unknown key too), a parallel shape the model or the "
          "machine cannot take, a model directory without config.json, tokenizer.json or safetensors weights "
          "of config.json's shapes, a run dir that cannot be written or that others own or may enter, a model "
          "cache that cannot be written or lacks room for the default model, a port in use, or a second "
          "supervisor for a --name that is already served. One line on stderr says what to fix."),
    ("130", "Interrupted before the command finished."),
]

# variables read outside the options (or read beyond them), with what they do
ENVIRONMENT = {
    "VSUP_HOME": "Where run dirs live: {$VSUP_HOME/NAME}. Default: {$XDG_STATE_HOME/vsup}, else "
                 "{~/.local/state/vsup}.",
    "VSUP_CACHE_DIR": "Where the default model is converted once and kept: {$VSUP_CACHE_DIR/models}. "
                      "Default: {$XDG_CACHE_HOME/vsup}, else {~/.cache/vsup}.",
    "VSUP_API_KEY": "`vsup serve` hands --api-key to the API servers (with --engine vllm, to its front) in this variable.",
    "VSUP_ENABLE_MULTIPROCESSING": "0 runs the engine core (and with TP = PP = 1 the worker) inside the "
                                   "API server process; the engine's processes read it too.",
    "VSUP_LOG_FORMAT": "Also read by every engine process; `vsup serve` sets it to json for its children, "
                       "whose lines it parses.",
    "VSUP_LOG_LEVEL": "The lowest level every process logs: debug, info (the default), warning or error. "
                      "The children of `vsup serve` inherit it.",
    "VSUP_CPUS": "Set by `vsup serve` for each process it pins (see --cpu-reserve): the CPUs it pins itself "
                 "to at start. VSUP_THREADS (a worker's torch threads, an API server's tokenizer threads) and "
                 "VSUP_NICE (its nice value) go with it.",
    "VSUP_PACKED_LINEAR": "0 makes CPU workers run their linear layers through F.linear instead of "
                          "oneDNN-packed weights (float32 on the CPU packs by default: faster, same results).",
    "VSUP_CPU_KERNELS": "0 makes CPU workers run decode attention, the KV write, the fused norm, rotary, "
                        "SiLU, the greedy argmax and a decode step's layer loop in plain torch and Python "
                        "instead of the kernels of engine/ops/csrc "
                        "(built once per machine by `make install`, or at a worker's first start, into torch's "
                        "extension cache; the same values up to float rounding).",
    "VSUP_HOOK_SOCKET": "With --engine vllm, set by `vsup serve` for the start-up hook it puts on vLLM's "
                        "PYTHONPATH: the supervisor's socket that every process of the tree connects its stdout "
                        "and stderr to. VSUP_HOOK_PARENT (the pid a process's parent must have), VSUP_HOOK_SHM_LOG "
                        "(where the hook lists the shared memory it saw created), VSUP_HOOK_REAP_LOG (where it "
                        "lists each child a process reaped, and how that child ended) and VSUP_HOOK_REPLICA (the "
                        "tree's replica, with --replicas) go with it.",
    "VSUP_HOOK_PARENT": "See VSUP_HOOK_SOCKET.",
    "VSUP_HOOK_REPLICA": "See VSUP_HOOK_SOCKET.",
    "VSUP_HOOK_SHM_LOG": "See VSUP_HOOK_SOCKET.",
    "VSUP_HOOK_REAP_LOG": "See VSUP_HOOK_SOCKET.",
    "VSUP_HOOK_TEST_FD2": "Tests and benches only: {TITLE|TEXT[|COUNT]} makes the process of a vLLM tree "
                          "titled TITLE write TEXT to its fd 2 natively.",
    "VSUP_HOOK_TEST_POISON": "Tests and benches only: {ID,ID,...} makes an engine core of a vLLM tree kill "
                             "itself when it is given a prompt that holds those token IDs in a row.",
    "VSUP_FRONT_UPSTREAM_KEY": "With --engine vllm, set by `vsup serve` for its front: the random API key of the "
                               "vLLM behind it, which only the front knows.",
    "NOTIFY_SOCKET": "Set by systemd for a Type=notify service: `vsup serve` sends READY=1 once every "
                     "process is ready and STOPPING=1 when it begins to stop.",
    "VSUP_DEBUG": "1 prints the traceback of an internal error on stderr, besides the line that names the file "
                  "it was saved to.",
    "XDG_STATE_HOME": "The base of the run dirs when VSUP_HOME is unset.",
    "XDG_CACHE_HOME": "The base of the model cache when VSUP_CACHE_DIR is unset.",
}
# set by `vsup serve` in each child's environment, never by hand
CHILD_ENVIRONMENT = ("VSUP_PROCESS_NAME", "VSUP_PROCESS_TITLE", "VSUP_SUPERVISOR_PID")


def escape(text: str) -> str:
    """Plain text as roff: backslashes, dashes (copyable option names), non-ASCII, leading control characters."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    text = "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in text)
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in text.split("\n"))


def prose(text: str) -> str:
    """Help text as roff: escaped, with `code` in bold."""
    return re.sub(r"`([^`]+)`", r"\\fB\1\\fR", escape(text))


def markup(text: str) -> str:
    """This file's prose as roff: `code` in bold, {a path or a value} in italics."""
    return re.sub(r"\{([^{}]+)\}", r"\\fI\1\\fR", prose(text))


def term(opts: str) -> str:
    """A --help term like '-tp, --tensor-parallel-size <int>': option names bold, metavars italic."""
    parts = re.split(r"(, | / | )", opts)
    out = []
    for part in parts:
        if part in (", ", " / ", " "):
            out.append(escape(part))
        elif part.startswith("-"):
            out.append(f"\\fB{escape(part)}\\fR")
        elif part:
            out.append(f"\\fI{escape(part)}\\fR")
    return "".join(out)


def usage(pieces: list[str]) -> str:
    return " ".join(re.sub(r"[A-Z]+", lambda m: f"\\fI{m.group(0)}\\fR", escape(p)) for p in pieces)


def paragraphs(help_text: str) -> list[str]:
    return [" ".join(line.strip() for line in p.splitlines()) for p in re.split(r"\n\s*\n", help_text.strip())]


def option_entries(command, ctx) -> list[str]:
    lines = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        opts, help_text = record
        help_text, *extras = re.split(r"\s{2,}(?=\[)", help_text)
        lines += [".TP", term(opts), prose(help_text)]
        if extras:
            lines += [".br", prose(" ".join(extras))]
    return lines


def commands(root, root_ctx):
    """(name, click command, its context) for every visible subcommand, in the app's order."""
    for name in root.list_commands(root_ctx):
        command = root.get_command(root_ctx, name)
        if command is None or command.hidden:
            continue
        yield name, command, command.make_context(name, [], parent=root_ctx, resilient_parsing=True)


def option_variables(root, root_ctx) -> dict[str, list[tuple[str, str]]]:
    """VSUP_* variable -> [(command, the option's names)] for every option that has one."""
    found: dict[str, list[tuple[str, str]]] = {}
    for name, command, ctx in commands(root, root_ctx):
        for param in command.get_params(ctx):
            envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
            for envvar in envvars:
                found.setdefault(envvar, []).append((name, "/".join(param.opts + param.secondary_opts)))
    return found


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def ipc_socket_names() -> list[str]:
    """The run dir's sockets between processes, named as vsup.addresses names them (N a rank)."""
    from vsup import addresses as a

    urls = [a.api_server_engine_socket("", "N"), a.core_worker_socket("", "N"), a.core_control_socket("", "N"),
            a.ring_wakeup_socket("", "N"), a.coordinator_input_socket(""), a.coordinator_output_socket("")]
    return [url.split("://", 1)[1] for url in urls]


def files_section() -> list[str]:
    from vsup import addresses
    from vsup.supervisor.log_router import KEEP_FILES, ROTATE_BYTES

    sockets = ", ".join("{" + name + "}" for name in ipc_socket_names())
    entries = [
        ("$VSUP_HOME/NAME", "The run dir of deployment NAME (--name, default {default}), mode 0700. VSUP_HOME "
                            "defaults to {$XDG_STATE_HOME/vsup}, else {~/.local/state/vsup}, so the default "
                            "run dir is {~/.local/state/vsup/default}."),
        ("$VSUP_HOME/NAME/state.json", "Every process with its pid, state, restarts and last exit, replaced "
                                       "atomically on every change and kept after exit for `vsup ps`."),
        ("$VSUP_HOME/NAME/logs/vsup.jsonl", "Every tagged line of every process, one JSON object a line (ts, level, "
                                            "role, dp, pp, tp, pid, stream, event, ...); past "
                                            f"{ROTATE_BYTES >> 20} MiB it is rotated to {{vsup.jsonl.1}} ... "
                                            f"{{vsup.jsonl.{KEEP_FILES}}}. `vsup logs` reads it."),
        ("$VSUP_HOME/NAME/logs/crash-*.log", "The traceback of an internal error of a command that knew its run "
                                             "dir (else it goes to a {vsup-*.log} temp file)."),
        ("$VSUP_HOME/NAME/control.sock", "The supervisor's control socket (mode 0600), for `vsup ps`, `stop` and "
                                         "`restart`."),
        ("$VSUP_HOME/NAME/supervisor.pid", "The pid of the supervisor serving NAME, locked while it runs, so a "
                                           "second one is refused."),
        ("$VSUP_HOME/NAME/*.sock", "The ZeroMQ IPC sockets between API servers, engine cores, workers and the "
                                   f"coordinator: {sockets} (N a rank)."),
        (f"/dev/shm/{addresses.ring_prefix('NAME', 'N')}-*", "The shared-memory ring an engine core writes each "
                                                             "step to for its workers."),
        ("~/.cache/vsup/models", "The model cache: the default model, converted once from its GGUF file; "
                                 "{$VSUP_CACHE_DIR/models} when that is set, else {$XDG_CACHE_HOME/vsup/models}."),
    ]
    lines = []
    for path, text in entries:
        lines += [".TP", f"\\fI{escape(path)}\\fR", markup(text)]
    return lines


def environment_section(root, root_ctx) -> list[str]:
    by_option = option_variables(root, root_ctx)
    lines = [".PP", markup("Each option that names a variable in its help can be set through it (booleans take 1, "
                           "true, yes or on, and 0, false, no or off); a flag on the command line wins over it, "
                           "and it wins over a --config file.")]
    for name in sorted(set(by_option) | {n for n in ENVIRONMENT if n.startswith("VSUP_")}):
        text = []
        if name in by_option:
            where: dict[str, list[str]] = {}
            for command, opts in by_option[name]:
                where.setdefault(opts, []).append(command)
            text.append("Sets " + "; ".join(f"`{opts}` of {_and(cmds)}" for opts, cmds in where.items()) + ".")
        if name in ENVIRONMENT:
            text.append(ENVIRONMENT[name])
        lines += [".TP", f"\\fB{escape(name)}\\fR", markup(" ".join(text))]
    for name in sorted(n for n in ENVIRONMENT if not n.startswith("VSUP_")):
        lines += [".TP", f"\\fB{escape(name)}\\fR", markup(ENVIRONMENT[name])]
    lines += [".PP", markup("`vsup serve` sets " + ", ".join(f"`{n}`" for n in CHILD_ENVIRONMENT)
                            + " in the environment of each process it starts, to name it and tie it to its "
                              "supervisor; they are not meant to be set by hand.")]
    return lines


def render() -> str:
    import typer.main

    from vsup import __version__
    from vsup.cli.main import app

    root = typer.main.get_command(app)
    root_ctx = root.make_context("vsup", [], resilient_parsing=True)
    subcommands = list(commands(root, root_ctx))
    summary = paragraphs(root.help)[0].rstrip(".")
    out = [
        '.\\" Generated by man/generate.py from the vsup command line; edit that, then run: make man',
        f'.TH VSUP 1 "" "vsup {__version__}" "User Commands"',
        ".nh",
        ".ad l",
        ".SH NAME",
        f"vsup \\- {escape(summary[0].lower() + summary[1:])}",
        ".SH SYNOPSIS",
        ".nf",
        f"\\fBvsup\\fR {usage(root.collect_usage_pieces(root_ctx))}",
        *[f"\\fBvsup {name}\\fR {usage(command.collect_usage_pieces(ctx))}" for name, command, ctx in subcommands],
        ".fi",
        ".SH DESCRIPTION",
    ]
    for i, text in enumerate(DESCRIPTION):
        out += ([".PP"] if i else []) + [markup(text)]
    out += [".SH OPTIONS", *option_entries(root, root_ctx), ".SH COMMANDS"]
    for name, command, ctx in subcommands:
        out += [f'.SS "vsup {name}"']
        for i, text in enumerate(paragraphs(command.help or "")):
            out += ([".PP"] if i else []) + [prose(text)]
        out += option_entries(command, ctx)
    out += [".SH CONFIGURATION FILE", *map(markup, CONFIG_FILE), ".PP", ".RS 4", ".nf", escape(CONFIG_EXAMPLE).rstrip("\n"),
            ".fi", ".RE"]
    out += [".SH EXAMPLES"]
    for text, lines in EXAMPLES:
        out += [".PP", markup(text), ".RS 4", ".nf", *[f"\\fB{escape(line)}\\fR" for line in lines], ".fi", ".RE"]
    out += [".SH FILES", *files_section()]
    out += [".SH ENVIRONMENT", *environment_section(root, root_ctx)]
    out += [".SH EXIT STATUS"]
    for code, text in EXIT_STATUS:
        out += [".TP", f"\\fB{code}\\fR", markup(text)]
    out += [".SH SEE ALSO", markup("`vsup` {COMMAND} `--help`, `systemd.service`(5), `sd_notify`(3)")]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "vsup.1", help="where to write (default: man/vsup.1)")
    args = parser.parse_args()
    args.out.write_text(render())
    print(args.out)


if __name__ == "__main__":
    main()
