"""The process tree: one pure function from the parallel flags to the processes.

`vsup plan` prints what `plan()` returns and `vsup serve` launches exactly it,
so the prediction cannot drift from what runs. No I/O, no torch, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vsup import addresses
from vsup.errors import UsageError
from vsup.roles import API_SERVER, COORDINATOR, COUNTED, ENGINE_CORE, FRONT, ROLES, WORKER  # noqa: F401 (theirs too)
# far beyond any deployment: a plan is built process by process, and `-tp 10000000000` must be a line, not a hang
MAX_PROCESSES = 65536

# the module each role runs: the argv contract between vsup and engine
ENTRY_POINTS = {
    API_SERVER: "engine.api_server",
    ENGINE_CORE: "engine.core",
    WORKER: "engine.worker",
    COORDINATOR: "engine.coordinator",
}


def process_name(role: str, *, a: int | None = None, dp: int | None = None,
                 pp: int | None = None, tp: int | None = None, r: int | None = None) -> str:
    """The one spelling of a process: `api-server a0`, `worker dp0 pp0 tp1`; with vLLM replicas, the
    replica comes first: `worker r1 dp0 pp0 tp0`."""
    parts = [role]
    if r is not None:
        parts.append(f"r{r}")
    if a is not None:
        parts.append(f"a{a}")
    for prefix, rank in (("dp", dp), ("pp", pp), ("tp", tp)):
        if rank is not None:
            parts.append(f"{prefix}{rank}")
    return " ".join(parts)


def process_title(name: str) -> str:
    """The process title a child sets: `vsup::worker_dp0_pp0_tp1`."""
    return "vsup::" + name.replace(" ", "_")


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel shape of a deployment, as the flags give it.

    `device` is already resolved to "cpu" or "cuda" (resolving "auto" needs
    I/O, which lives in vsup.devices). Sizes are checked here, so every
    caller gets the same errors.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    api_server_count: int | None = None
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None
    headless: bool = False
    dp_address: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    device: str = "cpu"
    multiprocessing: bool = True

    def __post_init__(self):
        for flag, value in (("-tp/--tensor-parallel-size", self.tensor_parallel_size),
                            ("-pp/--pipeline-parallel-size", self.pipeline_parallel_size),
                            ("-dp/--data-parallel-size", self.data_parallel_size)):
            if value < 1:
                raise UsageError(f"{flag} must be at least 1 (got {value})")
        if self.device not in ("cpu", "cuda"):
            raise UsageError(f"--device must be auto, cuda or cpu (got {self.device!r})")
        if self.api_server_count is not None and self.api_server_count < 0:
            raise UsageError(f"--api-server-count must be at least 1 (got {self.api_server_count})")
        if self.process_count > MAX_PROCESSES:
            raise UsageError(f"-dp x -tp x -pp and --api-server-count make {self.process_count:,} processes, more "
                             f"than the {MAX_PROCESSES:,} vsup plans for: check them for a typo")
        self._check_nodes()
        self._check_in_process()

    def _check_nodes(self):
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1 (got {self.nnodes})")
        if self.nnodes > 1 or self.node_rank:
            self._check_spanning()
            return
        dp, local, start = self.data_parallel_size, self.data_parallel_size_local, self.data_parallel_start_rank
        if local is not None and not 1 <= local <= dp:
            raise UsageError(f"--dp-size-local must be between 1 and -dp/--data-parallel-size ({dp}), got {local}")
        if self.headless:
            if start is None:
                raise UsageError("--headless needs --dp-start-rank: the first data-parallel rank this node runs")
            if start < 1:
                raise UsageError("--dp-start-rank must be at least 1 on a headless node: rank 0 runs on the head node")
        elif start not in (None, 0):
            raise UsageError(f"--dp-start-rank {start} needs --headless: the head node always runs rank 0")
        first = start or 0
        if first + self.dp_size_local > dp:
            raise UsageError(
                f"--dp-start-rank {first} + --dp-size-local {self.dp_size_local} exceeds "
                f"-dp/--data-parallel-size {dp}; lower one of them")
        if self.headless and not self.dp_address:
            raise UsageError("--headless needs --dp-address HOST:PORT: where the head node's API servers "
                             "and coordinator listen")
        if self.api_server_count == 0:
            raise UsageError("--api-server-count must be at least 1 (a --headless node runs none; there it "
                             "counts the head node's)")
        if not self.headless and self.dp_size_local < dp and not self.dp_address:
            raise UsageError(f"--dp-size-local {self.dp_size_local} of -dp {dp} leaves ranks {self.dp_size_local}-"
                             f"{dp - 1} to other nodes: give --dp-address HOST:PORT where they reach this head node")
        if self.dp_address:
            self._check_dp_address()

    def _check_spanning(self):
        """One TP x PP group across --nnodes nodes."""
        n, rank, workers = self.nnodes, self.node_rank, self.workers_per_engine
        if not 0 <= rank < n:
            raise UsageError(f"--node-rank must be between 0 and --nnodes - 1 ({n - 1}), got {rank}")
        if self.data_parallel_size > 1 or self.dp_address or self.data_parallel_start_rank is not None:
            raise UsageError("--nnodes spans one TP x PP group across nodes and needs -dp 1; data-parallel ranks "
                             "cross nodes with --dp-address (and --headless --dp-start-rank) instead")
        if workers % n:
            raise UsageError(f"-tp x -pp ({workers}) must be a multiple of --nnodes ({n}): every node runs "
                             f"as many workers of the group")
        if rank > 0 and not self.headless:
            raise UsageError(f"--node-rank {rank} runs only its workers: add --headless (node 0 runs the rest)")
        if rank == 0 and self.headless:
            raise UsageError("--headless with --nnodes needs --node-rank 1 or more: node 0 runs the engine core")
        if not 1 <= self.master_port <= 65535 - 2:
            raise UsageError(f"--master-port must be between 1 and 65533 (it uses the next two ports too), "
                             f"got {self.master_port}")

    @property
    def master(self) -> str | None:
        """'HOST:PORT' where a group spanning nodes meets, else None."""
        return f"{self.master_addr}:{self.master_port}" if self.nnodes > 1 else None

    @property
    def workers_per_node(self) -> int:
        return self.workers_per_engine // self.nnodes

    def _check_dp_address(self):
        if self.data_parallel_size < 2:
            raise UsageError("--dp-address is where other nodes' DP ranks join: it needs -dp/--data-parallel-size > 1")
        try:
            _, port = addresses.split_host_port(self.dp_address)
        except ValueError as e:
            raise UsageError(f"--dp-address: {e}") from None
        last = port + addresses.DP_PORTS["api-server a0"] + self.head_api_server_count - 1
        if last > 65535:
            raise UsageError(f"--dp-address port {port} is too high: the head node uses ports {port}-{last}")

    def _check_in_process(self):
        if self.multiprocessing:
            return
        if self.data_parallel_size > 1:
            raise UsageError("--no-multiprocessing needs -dp/--data-parallel-size 1: each DP rank is its own engine core process")
        if (self.api_server_count or 1) > 1:
            raise UsageError("--no-multiprocessing needs --api-server-count 1: the engine core runs inside the one API server")
        if self.headless or self.nnodes > 1:
            raise UsageError("--no-multiprocessing cannot be combined with --headless or --nnodes: "
                             "the one process cannot span nodes")

    @property
    def dp_size_local(self) -> int:
        """How many DP ranks run on this node."""
        if self.data_parallel_size_local is not None:
            return self.data_parallel_size_local
        return self.data_parallel_size - (self.data_parallel_start_rank or 0)

    @property
    def dp_start_rank(self) -> int:
        return self.data_parallel_start_rank or 0

    @property
    def process_count(self) -> int:
        """The processes of the whole deployment, all nodes together, as the count formula gives them."""
        dp = self.data_parallel_size
        return self.head_api_server_count + dp * (1 + self.workers_per_engine) + (dp > 1)

    @property
    def workers_per_engine(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def num_api_servers(self) -> int:
        """The API servers on this node."""
        return 0 if self.headless else self.head_api_server_count

    @property
    def head_api_server_count(self) -> int:
        """The API servers on the head node, which every engine core connects to (headless nodes too)."""
        return self.api_server_count if self.api_server_count is not None else self.data_parallel_size

    @property
    def devices_per_node(self) -> int:
        """Devices that this node's workers need: one each."""
        return self.dp_size_local * self.workers_per_node

    def node_of(self, dp_rank: int) -> int:
        """The node a DP rank lives on: the head (0) holds the first ranks;
        every other node is assumed to hold as many as this one."""
        local = self.dp_size_local
        if self.headless:
            return -(-self.dp_start_rank // local) + (dp_rank - self.dp_start_rank) // local
        return 0 if dp_rank < local else 1 + (dp_rank - local) // local


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the tree: what `plan` shows and `serve` starts."""

    role: str
    name: str
    title: str
    node: int
    device: str | None
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    a: int | None = None
    dp: int | None = None
    pp: int | None = None
    tp: int | None = None
    r: int | None = None  # the vLLM replica (--replicas), when there are several

    def to_json(self) -> dict:
        replica = {"r": self.r} if self.r is not None else {}
        return {"name": self.name, "role": self.role, **replica, "dp": self.dp, "pp": self.pp,
                "tp": self.tp, "device": self.device, "title": self.title, "node": self.node}


@dataclass(frozen=True)
class Plan:
    """The processes of a deployment and the count formula with its terms."""

    config: ParallelConfig
    processes: tuple[ProcessSpec, ...]
    roles: tuple[str, ...] = ROLES  # in formula order; a role beyond COUNTED (vLLM's helpers) is counted apart

    @property
    def total(self) -> int:
        return len(self.processes)

    def count(self, role: str) -> int:
        return sum(p.role == role for p in self.processes)

    @property
    def formula(self) -> str:
        def terms(roles) -> list[str]:
            return [f"{n} {role}{'' if n == 1 else 's'}" for role in roles if (n := self.count(role))]

        counted = [r for r in self.roles if r in COUNTED]
        main = sum(self.count(role) for role in counted)
        text = f"{' + '.join(terms(counted))} = {main} process{'' if main == 1 else 'es'}"
        helpers = terms(r for r in self.roles if r not in COUNTED)
        return f"{text}, plus {' + '.join(helpers)}: {self.total} in all" if helpers else text

    def nodes(self) -> list[int]:
        return sorted({p.node for p in self.processes})

    def on_node(self, node: int) -> list[ProcessSpec]:
        return [p for p in self.processes if p.node == node]

    def to_json(self) -> dict:
        return {"total": self.total, "formula": self.formula,
                "processes": [p.to_json() for p in self.processes]}


def meeting_args(config: ParallelConfig, role: str, run_dir: str, deployment: str, *,
                 a: int | None = None, dp: int | None = None, **_) -> tuple[str, ...]:
    """The sockets and shared-memory names a process needs to find its peers."""
    has_coordinator = config.data_parallel_size > 1
    net = config.dp_address  # None: every socket is ipc:// in the run dir
    master = config.master   # None: the worker group lives on one node
    if role == API_SERVER:
        coordinator = ("--coordinator-address", addresses.coordinator_output_socket(run_dir, net)) if has_coordinator else ()
        workers = ()
        if not config.multiprocessing and config.workers_per_engine > 1:  # the core, inside, meets its workers
            workers = ("--worker-address", addresses.core_worker_socket(run_dir, 0),
                       "--ring-prefix", addresses.ring_prefix(deployment, 0),
                       "--wakeup-address", addresses.ring_wakeup_socket(run_dir, 0))
        return ("--engine-address", addresses.api_server_engine_socket(run_dir, a, net),
                "--state-file", addresses.state_file(run_dir), "--metrics-dir", addresses.metrics_dir(run_dir),
                "--supervisor-socket", addresses.control_socket(run_dir), *coordinator, *workers)
    if role == ENGINE_CORE:
        servers = [x for i in range(config.head_api_server_count)
                   for x in ("--api-server-address", addresses.api_server_engine_socket(run_dir, i, net))]
        coordinator = ("--coordinator-address", addresses.coordinator_input_socket(run_dir, net),
                       "--wave-address", addresses.coordinator_wave_socket(run_dir, net)) if has_coordinator else ()
        remote = ("--ring-remote-address", addresses.ring_remote_socket(master)) if master else ()
        return (*servers, "--worker-address", addresses.core_worker_socket(run_dir, dp, master), *remote,
                "--control-address", addresses.core_control_socket(run_dir, dp),
                "--ring-prefix", addresses.ring_prefix(deployment, dp),
                "--wakeup-address", addresses.ring_wakeup_socket(run_dir, dp), *coordinator)
    if role == WORKER:
        return ("--core-address", addresses.core_worker_socket(run_dir, dp, master))
    return ("--input-address", addresses.coordinator_input_socket(run_dir, net),
            "--output-address", addresses.coordinator_output_socket(run_dir, net),
            "--wave-address", addresses.coordinator_wave_socket(run_dir, net))


def plan(config: ParallelConfig, *, python: str = "python", engine_args: tuple[str, ...] = (),
         run_dir: str | None = None, deployment: str = "default") -> Plan:
    """Every process of the deployment, in start order of roles.

    `python`, `engine_args`, `run_dir` and `deployment` only shape argv: the
    interpreter that runs the children, the flags (model, limits, ...) that
    every child receives, and where in the run dir each finds its peers.
    """
    tree = _Tree(config, python, engine_args, run_dir, deployment)
    if not config.multiprocessing:
        return Plan(config, tree.in_process())
    if config.nnodes > 1:
        return Plan(config, tree.spanning_nodes())
    return Plan(config, tree.data_parallel())


@dataclass(frozen=True)
class _Tree:
    """How one deployment's processes are spelled: their names, argv and devices."""

    config: ParallelConfig
    python: str
    engine_args: tuple[str, ...]
    run_dir: str | None
    deployment: str

    # the three shapes

    def in_process(self) -> tuple[ProcessSpec, ...]:
        """--no-multiprocessing: the engine core runs inside the API server; with TP = PP = 1 the worker too."""
        inside = self.config.workers_per_engine == 1
        server = self.spec(API_SERVER, 0, self.device_of(0, 0, 0) if inside else None,
                           ("--api-server-rank", "0", "--api-server-count", "1", "--no-multiprocessing"), a=0)
        return (server, *(() if inside else self.workers(0, 0)))

    def spanning_nodes(self) -> tuple[ProcessSpec, ...]:
        """One TP x PP group across --nnodes nodes: node 0 has the API servers and the core."""
        c = self.config
        workers = [self.worker(0, pp, tp, (pp * c.tensor_parallel_size + tp) // c.workers_per_node)
                   for pp in range(c.pipeline_parallel_size) for tp in range(c.tensor_parallel_size)]
        if c.headless:
            return tuple(w for w in workers if w.node == c.node_rank)
        return (*self.api_servers(0), self.spec(ENGINE_CORE, 0, None, ("--dp-rank", "0"), dp=0), *workers)

    def data_parallel(self) -> tuple[ProcessSpec, ...]:
        """DP ranks of TP x PP workers each, this node's share of them (all on one node)."""
        c = self.config
        first = c.dp_start_rank
        dp_ranks = range(first, c.data_parallel_size) if not c.headless else range(first, first + c.dp_size_local)
        head = c.node_of(first)
        cores = [self.spec(ENGINE_CORE, c.node_of(dp), None, ("--dp-rank", str(dp)), dp=dp) for dp in dp_ranks]
        workers = [w for dp in dp_ranks for w in self.workers(dp, c.node_of(dp))]
        coordinator = [self.spec(COORDINATOR, head, None, ())] if c.data_parallel_size > 1 and not c.headless else []
        return (*self.api_servers(head), *cores, *workers, *coordinator)

    # the parts

    def api_servers(self, node: int) -> list[ProcessSpec]:
        count = str(self.config.num_api_servers)
        return [self.spec(API_SERVER, node, None, ("--api-server-rank", str(a), "--api-server-count", count), a=a)
                for a in range(self.config.num_api_servers)]

    def workers(self, dp: int, node: int) -> list[ProcessSpec]:
        """The TP x PP worker group of DP rank `dp`."""
        return [self.worker(dp, pp, tp, node)
                for pp in range(self.config.pipeline_parallel_size) for tp in range(self.config.tensor_parallel_size)]

    def worker(self, dp: int, pp: int, tp: int, node: int) -> ProcessSpec:
        device = self.device_of(dp, pp, tp)
        spanning = ("--node-rank", str(node)) if self.config.nnodes > 1 else ()
        return self.spec(WORKER, node, device, ("--dp-rank", str(dp), "--pp-rank", str(pp), "--tp-rank", str(tp),
                                                "--device", device, *spanning), dp=dp, pp=pp, tp=tp)

    def device_of(self, dp: int, pp: int, tp: int) -> str:
        c = self.config
        if c.device == "cpu":
            return "cpu"
        if c.nnodes > 1:
            return f"cuda:{(pp * c.tensor_parallel_size + tp) % c.workers_per_node}"
        local_index = (dp - c.dp_start_rank) % c.dp_size_local
        return f"cuda:{local_index * c.workers_per_engine + pp * c.tensor_parallel_size + tp}"

    def spec(self, role: str, node: int, device: str | None, rank_args: tuple[str, ...], **ranks) -> ProcessSpec:
        c = self.config
        name = process_name(role, **ranks)
        title = process_title(name)
        meet = meeting_args(c, role, self.run_dir, self.deployment, **ranks) if self.run_dir is not None else ()
        sizes = ("--tensor-parallel-size", str(c.tensor_parallel_size), "--pipeline-parallel-size",
                 str(c.pipeline_parallel_size), "--data-parallel-size", str(c.data_parallel_size))
        argv = (self.python, "-m", ENTRY_POINTS[role], *rank_args, *meet, *sizes, *self.engine_args)
        env = {"VSUP_PROCESS_NAME": name, "VSUP_PROCESS_TITLE": title}
        return ProcessSpec(role=role, name=name, title=title, node=node, device=device, argv=argv, env=env, **ranks)
