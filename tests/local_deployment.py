"""A whole serving tree on this machine without vsup: for tests and benchmarks of the API server.

`LocalDeployment` starts API servers, engine cores and their workers (and a
coordinator with DP > 1) with the argv that vsup's own `topology.plan` gives
them, and plays supervisor where a test needs it
(kill -9 of a core, a replacement). Each process writes its log to
`<run_dir>/logs/<name>.log`, never to a pipe nobody drains.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from vsup import addresses
from vsup.serve_flags import ServeFlags, engine_args
from vsup.topology import (API_SERVER, COORDINATOR, ENGINE_CORE, WORKER, ParallelConfig, Plan, ProcessSpec,
                           plan)

TEST_CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<s>assistant: {% endif %}")
# the UTF-8 bytes of é, 😀 and 你: a random model strings them into whole and broken characters
MULTIBYTE_PIECES = [bytes([b]) for b in "é😀你".encode()]
WORDS = ("the of and to in is it that was for on are with as his they be at one have this from or had by hot "
         "word but what some we can out other were all there when up use your how said an each she which do "
         "their time if will way about many then them write would like so these her long make thing see him two "
         "has look more day could go come did number sound no most people my over know water than call first who "
         "may down side been now find").split()


def tiny_vocabulary() -> list[bytes]:
    """256 pieces: <unk> <s> </s>, printable ASCII and newline, nine bytes of multi-byte
    characters, then whole words, so that a random model writes mostly readable text."""
    pieces = [bytes([c]) for c in range(32, 127)] + [b"\n"] + MULTIBYTE_PIECES
    pieces += [f" {w}".encode() for w in WORDS]
    pieces += [f"{a}{b}".encode() for a in "etaoinsrh" for b in "etaoinsrh"]  # bigrams fill up
    return pieces[:253]


def with_test_tokenizer(model_dir: str | Path, dest: str | Path) -> Path:
    """A copy of a tokenizer-less test model (vocabulary 256) with a tokenizer and a chat template.

    Ids 0, 1, 2 are <unk>, <s>, </s> (Llama's defaults); the rest are
    `tiny_vocabulary()`. Prompts encode character by character (no merges);
    outputs decode words, and broken or whole multi-byte characters.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    dest = Path(dest)
    shutil.copytree(model_dir, dest, dirs_exist_ok=True)
    to_char = _gpt2_bytes_to_unicode()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for piece in tiny_vocabulary():
        vocab["".join(to_char[b] for b in piece)] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tokenizer.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": TEST_CHAT_TEMPLATE}))
    return dest


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalDeployment:
    """A API servers, D engine cores, one worker per core (TP = PP = 1), on 127.0.0.1:port."""

    def __init__(self, model_dir: str | Path, run_dir: str | Path, *, num_api_servers: int = 1,
                 data_parallel_size: int = 1, port: int | None = None, served_model_name: str = "model",
                 max_model_len: int | None = None, kv_cache_bytes: int = 4 << 20, block_size: int = 16,
                 api_args: tuple[str, ...] = (), core_args: tuple[str, ...] = (), env: dict | None = None):
        self.model_dir, self.run_dir = str(model_dir), Path(run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.num_api_servers, self.data_parallel_size = num_api_servers, data_parallel_size
        self.port = port or free_port()
        self.served_model_name = served_model_name
        self.max_model_len, self.kv_cache_bytes, self.block_size = max_model_len, kv_cache_bytes, block_size
        self.api_args, self.core_args = tuple(api_args), tuple(core_args)
        self.env = {**os.environ, **(env or {})}
        self.tag = uuid.uuid4().hex[:8]
        self.procs: dict[str, subprocess.Popen] = {}
        self.replaced: list[subprocess.Popen] = []  # earlier holders of a name, still to be reaped
        self.generation = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def plan(self, in_process: bool = False) -> Plan:
        """The processes `vsup serve` would start for this shape, with the argv it would give them."""
        config = ParallelConfig(data_parallel_size=self.data_parallel_size, api_server_count=self.num_api_servers,
                                multiprocessing=not in_process)
        flags = ServeFlags(model=self.model_dir, served_model_name=self.served_model_name, host="127.0.0.1",
                           port=self.port, dtype="auto", max_num_seqs=256, seed=0, drain_timeout=30.0,
                           gpu_memory_utilization=0.9, max_model_len=self.max_model_len,
                           kv_cache_bytes=self.kv_cache_bytes)
        args = (*engine_args(flags, multiprocessing=not in_process), "--block-size", str(self.block_size))
        return plan(config, python=sys.executable, engine_args=args, run_dir=str(self.run_dir),
                    deployment=f"test-{self.tag}")

    # starting

    def start(self, in_process: bool = False) -> LocalDeployment:
        """Start everything (or one in-process API server); `wait_ready` waits for /health."""
        if in_process:
            self.spawn_spec(self.plan(in_process=True).processes[0])
            return self
        self.start_api_servers()
        for dp in range(self.data_parallel_size):
            self.start_core(dp)
        for spec in self.plan().processes:
            if spec.role == COORDINATOR:
                self.spawn_spec(spec)
        return self

    def start_api_servers(self) -> None:
        """Only the API servers: /health says 503 until a core is started."""
        for spec in self.plan().processes:
            if spec.role == API_SERVER:
                self.spawn_spec(spec)

    def start_core(self, dp: int) -> None:
        """Start (or replace) DP rank `dp`'s engine core and its worker."""
        for spec in self.plan().processes:
            if spec.dp == dp and spec.role == ENGINE_CORE:
                self.spawn_spec(spec)
        self.start_worker(dp)

    def start_worker(self, dp: int) -> None:
        """Start (or replace) DP rank `dp`'s worker: a new generation of its group."""
        self.generation += 1
        for spec in self.plan().processes:
            if spec.dp == dp and spec.role == WORKER:  # what the supervisor adds, and one thread each
                self.spawn_spec(spec, "--dist-init-method", addresses.dist_init_method(
                    str(self.run_dir), dp, self.generation), "--num-threads", "1")

    def spawn_spec(self, spec: ProcessSpec, *extra: str) -> subprocess.Popen:
        """Start one process of the plan under its short name (a0, core-dp0, worker-dp0, coordinator), with
        this deployment's extra flags for its role."""
        own = {API_SERVER: self.api_args, ENGINE_CORE: ("--max-num-batched-tokens", "256", *self.core_args)}
        short = {API_SERVER: f"a{spec.a}", ENGINE_CORE: f"core-dp{spec.dp}", WORKER: f"worker-dp{spec.dp}"}
        argv = list(spec.argv[1:])
        if "--state-file" in argv:  # no supervisor writes one here: the API servers count restarts themselves
            i = argv.index("--state-file")
            del argv[i:i + 2]
        return self.spawn(short.get(spec.role, spec.name), [*argv, *own.get(spec.role, ()), *extra])

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        """`python argv...` with its output in logs/<name>.log; replaces an earlier holder of the name."""
        log = open(self.run_dir / "logs" / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        if name in self.procs:
            self.replaced.append(self.procs[name])
        self.procs[name] = proc
        return proc

    def wait_ready(self, timeout_s: float = 120.0, base_url: str | None = None) -> dict:
        """Wait until /health says 200; raise with the logs' tails if a process died or time ran out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"exited: {dead}\n{self.log_tails()}")
            try:
                with urllib.request.urlopen(f"{base_url or self.url}/health", timeout=2) as response:
                    return json.loads(response.read())
            except (OSError, ValueError):  # not listening yet, or 503 (HTTPError is an OSError)
                pass
            time.sleep(0.2)
        raise TimeoutError(f"not ready within {timeout_s} s\n{self.log_tails()}")

    # playing supervisor

    def kill(self, name: str) -> None:
        """kill -9 one process and reap it."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self, timeout_s: float = 20.0) -> dict[str, int]:
        """SIGTERM everything, SIGKILL what lingers; returns each process's exit code."""
        procs = [*self.procs.items(), *((f"replaced-{i}", p) for i, p in enumerate(self.replaced))]
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes = {}
        for name, proc in procs:
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes

    def stop_cleanly(self) -> None:
        """Stop; AssertionError unless every process (not one a test replaced) exited 0 and none logged a
        traceback (a request that made the server log one found a bug, even if it got its answer)."""
        codes = {name: code for name, code in self.stop().items() if not name.startswith("replaced-")}
        assert all(code == 0 for code in codes.values()), f"exit codes {codes}\n{self.log_tails()}"
        tracebacks = [name for name in self.procs if "Traceback" in self.log(name)]
        assert not tracebacks, "\n".join(f"--- {name}\n{self.log(name)[-3000:]}" for name in tracebacks)

    def log(self, name: str) -> str:
        """Everything process `name` (and its earlier holders) wrote."""
        path = self.run_dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tails(self, num_lines: int = 15) -> str:
        return "\n".join(f"--- {n}\n" + "\n".join(self.log(n).splitlines()[-num_lines:]) for n in self.procs)

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_tiny(tiny_model: Callable[[str], Path], **options) -> Iterator[LocalDeployment]:
    """A module's server (`yield from` it in a fixture): the tiny test model, with the test tokenizer, in a
    fresh short run dir (ipc:// paths have a 107-byte limit), ready; at the end stopped cleanly (see
    `stop_cleanly`) before the run dir goes."""
    run_dir = Path(tempfile.mkdtemp(prefix="vsup-"))
    yield from running(LocalDeployment(with_test_tokenizer(tiny_model("llama_tied"), run_dir / "model"), run_dir,
                                       **options))


def running(d: LocalDeployment) -> Iterator[LocalDeployment]:
    """`d` started and ready; at the end stopped cleanly (see `stop_cleanly`) before its run dir goes."""
    try:
        d.start()
        d.wait_ready()
        yield d
        d.stop_cleanly()
    finally:
        d.stop()
        shutil.rmtree(d.run_dir, ignore_errors=True)
