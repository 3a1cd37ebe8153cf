"""Every option of the CLI, defined once and shared by the commands that take it.

Each option can also be set as VSUP_<NAME> (e.g. VSUP_TENSOR_PARALLEL_SIZE=4);
a flag on the command line wins over the environment.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

PARALLEL = "Parallelism"
MEMORY = "Model and memory"


class Device(str, Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class LinearDType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


class KvCacheDType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


def _option(*decls: str, help: str, panel: str | None = None, envvar: str | None = None, **kwargs):
    long = next(d for d in decls if d.startswith("--")).split("/")[0]
    envvar = envvar or "VSUP_" + long.lstrip("-").replace("-", "_").upper()
    return typer.Option(*decls, help=help, envvar=envvar, rich_help_panel=panel, show_envvar=True, **kwargs)


Model = Annotated[Optional[str], typer.Argument(
    help="A local Hugging Face model directory (config.json, *.safetensors, tokenizer.json). "
         "plan works out the memory per worker and the token capacity for it; serve serves it "
         "(without one, SmolLM2-135M-Instruct).",
    show_default=False, metavar="MODEL")]

TensorParallelSize = Annotated[int, _option(
    "-tp", "--tensor-parallel-size", panel=PARALLEL,
    help="Workers that split each layer (one device each); must divide the model's attention and KV heads.")]
PipelineParallelSize = Annotated[int, _option(
    "-pp", "--pipeline-parallel-size", panel=PARALLEL,
    help="Pipeline stages, each a contiguous range of layers on its own workers.")]
DataParallelSize = Annotated[int, _option(
    "-dp", "--data-parallel-size", panel=PARALLEL,
    help="Data-parallel ranks: each is an engine core with its own worker group. DP > 1 adds a coordinator.")]
ApiServerCount = Annotated[Optional[int], _option(
    "--api-server-count", panel=PARALLEL, show_default=False,
    help="API server processes sharing the port; with --headless, how many the head node runs (this node "
         "runs none).  [default: the DP size]")]
Replicas = Annotated[int, _option(
    "--replicas", panel=PARALLEL,
    help="With --engine vllm: whole vLLM trees behind the one front, each on its own cores or GPUs. When one "
         "dies, the front sends its requests on to another at once, and `vsup restart --rolling` restarts "
         "them one at a time.")]
DpSizeLocal = Annotated[Optional[int], _option(
    "--dp-size-local", panel=PARALLEL, show_default=False,
    help="DP ranks that run on this node.  [default: all of them]")]
DpStartRank = Annotated[Optional[int], _option(
    "--dp-start-rank", panel=PARALLEL, show_default=False,
    help="The first DP rank this node runs (with --headless).")]
Headless = Annotated[bool, _option(
    "--headless", panel=PARALLEL,
    help="Run only engine cores and workers; they join the head node's API servers and coordinator "
         "at --dp-address.")]
DpAddress = Annotated[Optional[str], _option(
    "--dp-address", panel=PARALLEL, show_default=False, metavar="HOST:PORT",
    help="Where the head node's coordinator and API servers listen for other nodes' DP ranks (tcp, ports "
         "PORT to PORT+3+API servers-1, CurveZMQ with --cluster-secret); the same on every node.")]
ClusterSecret = Annotated[Optional[str], _option(
    "--cluster-secret", panel=PARALLEL, show_default=False,
    help="The shared secret that encrypts and authenticates traffic between nodes (CurveZMQ keys are derived "
         "from it); needed with --dp-address, the same on every node. Prefer the environment variable.")]
Nnodes = Annotated[int, _option(
    "--nnodes", panel=PARALLEL,
    help="Nodes one TP x PP group spans (with DP = 1; DP ranks cross nodes with --dp-address instead): each "
         "node runs TP x PP / NNODES of its workers, node 0 also the API servers and the engine core (with "
         "--engine vllm: vLLM's own --nnodes, and --probe-port on every node).")]
NodeRank = Annotated[int, _option(
    "--node-rank", panel=PARALLEL,
    help="This node's place among --nnodes; every node but 0 runs --headless (its workers only).")]
MasterAddr = Annotated[str, _option(
    "--master-addr", panel=PARALLEL,
    help="Node 0's address (--nnodes > 1): workers meet for torch.distributed at --master-port and reach "
         "the engine core at the next two ports (CurveZMQ with --cluster-secret).")]
MasterPort = Annotated[int, _option("--master-port", panel=PARALLEL, help="See --master-addr.")]
DpLockstep = Annotated[bool, _option(
    "--dp-lockstep", panel=PARALLEL,
    help="Step all DP ranks together while any has work, idle ranks running dummy steps (what "
         "mixture-of-experts models need); off: each rank steps only for its own requests.")]
DeviceOpt = Annotated[Device, _option(
    "--device", panel=PARALLEL, case_sensitive=False,
    help="Where workers run: auto picks cuda when a GPU is visible, else cpu.")]
Multiprocessing = Annotated[bool, _option(
    "--multiprocessing/--no-multiprocessing", panel=PARALLEL, envvar="VSUP_ENABLE_MULTIPROCESSING",
    help="--no-multiprocessing runs the engine core (and with TP = PP = 1 the worker) inside the one "
         "API server process, so scheduling order is repeatable. Needs DP = 1 and one API server.")]
CpuReserve = Annotated[Optional[int], _option(
    "--cpu-reserve", panel=PARALLEL, show_default=False, min=0,
    help="CPU cores kept for the API servers, engine cores and coordinator, apart from the CPU workers' "
         "cores, so that load on an API server (tokenizing long prompts) cannot slow decoding; vLLM-CPU "
         "keeps one too. 0 gives the model every core: more throughput, but the API servers then take "
         "the workers' CPU.  [default: a core for each of them as far as the cores go, leaving each CPU "
         "worker one: 1 on a 2-core host with one worker]")]

DTypeOpt = Annotated[DType, _option(
    "--dtype", panel=MEMORY, case_sensitive=False,
    help="Weight and KV cache dtype: auto is the model's own on CUDA; on the CPU float32, whose linears and KV "
         "cache are bfloat16 where the CPU computes it (avx512_bf16 or AMX), as vLLM-CPU runs a float32 model in "
         "bfloat16 there. float32 is float32 throughout (transformers' greedy tokens). With --engine vllm: "
         "vLLM's own, given only when set.")]
LinearDTypeOpt = Annotated[LinearDType, _option(
    "--linear-dtype", panel=MEMORY, case_sensitive=False,
    help="The dtype the linear layers and the LM head compute in: auto follows --dtype (see there). bfloat16 "
         "runs a float32 model's linears from bfloat16 weights, their inputs cast to it and their outputs back, "
         "while norms, attention and the KV cache stay float32 (like torch.autocast): on a CPU with avx512_bf16 or "
         "AMX, decode steps in half float32's time; greedy outputs part from float32's after some tokens.")]
KvCacheDTypeOpt = Annotated[KvCacheDType, _option(
    "--kv-cache-dtype", panel=MEMORY, case_sensitive=False,
    help="The dtype the KV cache stores: auto follows --dtype (see there). bfloat16 (on the CPU, for a float32 "
         "model) stores K and V rounded to bfloat16 while attention still sums in float32: a token takes half "
         "the bytes, so --kv-cache-memory holds twice the tokens and a decode step reads half as much; greedy "
         "outputs can part from float32's after some tokens.")]
MaxModelLen = Annotated[Optional[int], _option(
    "--max-model-len", panel=MEMORY, show_default=False,
    help="Longest prompt plus output, in tokens.  [default: the model's max_position_embeddings]")]
MaxGrammarBytes = Annotated[Optional[int], _option(
    "--max-grammar-bytes", panel=MEMORY, show_default=False, min=1,
    help="Largest JSON schema, regex, choice list or grammar a structured request may send; larger ones get a "
         "400.  [default: 65536]")]
KvCacheMemory = Annotated[Optional[str], _option(
    "--kv-cache-memory", panel=MEMORY, show_default=False,
    help="KV cache size per worker, like 4GiB or 512MiB.  [default: 1GiB on the CPU; on CUDA what "
         "--gpu-memory-utilization leaves after the weights]")]
GpuMemoryUtilization = Annotated[float, _option(
    "--gpu-memory-utilization", panel=MEMORY,
    help="Share of each GPU's memory that weights and KV cache may use (with --engine vllm, given only when "
         "set; on the CPU vLLM's share of the node's memory).")]

Json = Annotated[bool, _option("--json", help="Print JSON instead of text.")]


class EngineKind(str, Enum):
    vsup = "vsup"
    vllm = "vllm"


EngineOpt = Annotated[EngineKind, _option(
    "--engine", case_sensitive=False,
    help="vsup: the engine of this project (engine/). vllm: a stock `vllm serve`, which starts its own tree; "
         "vsup maps its flags to vLLM's, tags, shows and heals that tree, and passes what follows `--` to "
         "vLLM unchanged.")]
VllmBin = Annotated[Optional[str], _option(
    "--vllm-bin", metavar="PATH", show_default=False,
    help="The vllm executable for --engine vllm.  [default: vllm on PATH, else the project's .vllm-venv "
         "(make vllm)]")]

K8S = "Kubernetes (plan --k8s)"
SERVING = "Serving"
SUPERVISION = "Supervision"


class RestartPolicyOpt(str, Enum):
    always = "always"
    on_failure = "on-failure"
    never = "never"


class LogFormat(str, Enum):
    auto = "auto"
    text = "text"
    json = "json"


Name = Annotated[str, _option(
    "--name", help="The deployment: its run dir is $VSUP_HOME/NAME (default ~/.local/state/vsup/NAME).")]
Host = Annotated[str, _option("--host", panel=SERVING, help="Address the API servers listen on.")]
Port = Annotated[int, _option("--port", panel=SERVING, help="Port the API servers share.")]
ProbePort = Annotated[Optional[int], _option(
    "--probe-port", panel=SERVING, show_default=False,
    help="Serve the kubelet's probes on this port of --host, with no API key: /livez (the supervisor's loop "
         "turns; a restart inside it is no failure) and /readyz (every process of this node ready); with "
         "--engine vllm across nodes, where the nodes' vsups keep the group together.  "
         "[default: none]")]
ApiKey = Annotated[Optional[str], _option(
    "--api-key", panel=SERVING, show_default=False,
    help="Require 'Authorization: Bearer KEY' on every /v1 route (passed to the API servers in the environment).")]
ServedModelName = Annotated[Optional[str], _option(
    "--served-model-name", panel=SERVING, show_default=False,
    help="The model name clients use.  [default: the model directory's name]")]
MaxNumSeqs = Annotated[int, _option("--max-num-seqs", panel=MEMORY, help="Most requests an engine core runs at once.")]
Seed = Annotated[int, _option("--seed", panel=MEMORY, help="Random seed of requests that bring none.")]

RestartPolicyFlag = Annotated[RestartPolicyOpt, _option(
    "--restart-policy", panel=SUPERVISION, case_sensitive=False,
    help="Restart a unit whose process exited: always, on-failure (not after exit 0) or never.")]
MaxRestarts = Annotated[int, _option(
    "--max-restarts", panel=SUPERVISION, help="Restarts a unit may have within 300 s before it is marked failed.")]
RestartMaxDelay = Annotated[float, _option(
    "--restart-max-delay", panel=SUPERVISION,
    help="The longest wait before a restart: the wait starts at 0.5 s and doubles with each restart of a "
         "unit up to this, and starts over once the unit has run 60 s (as systemd's RestartMaxDelaySec).")]
DrainTimeout = Annotated[float, _option(
    "--drain-timeout", panel=SUPERVISION, help="Seconds in-flight requests get to finish on stop.")]
StopTimeout = Annotated[float, _option(
    "--stop-timeout", panel=SUPERVISION, help="Seconds each role gets to exit on stop before SIGKILL.")]
StartupTimeout = Annotated[float, _option(
    "--startup-timeout", panel=SUPERVISION, help="Seconds every process gets to report READY.")]
HealthTimeout = Annotated[float, _option(
    "--health-timeout", panel=SUPERVISION,
    help="With --engine vllm: restart the tree when its /health has failed this many seconds while it was up. "
         "On a --headless node: give up (exit 1) when the head node has not answered for this many seconds.")]
HangTimeout = Annotated[float, _option(
    "--hang-timeout", panel=SUPERVISION,
    help="With --engine vllm: restart the tree when requests are waiting and no token has come out for this "
         "many seconds (from vLLM's /metrics: vLLM can hang with /health at 200).")]
ResumeTimeout = Annotated[Optional[float], _option(
    "--resume-timeout", panel=SUPERVISION, show_default=False,
    help="With --engine vllm: how long the front holds a request whose vLLM tree died, waiting for the new one "
         "to come up, before it answers 503 (a held stream gets an SSE comment every 10 s meanwhile).  "
         "[default: --startup-timeout]")]
MaxPending = Annotated[int, _option(
    "--max-pending", panel=SUPERVISION,
    help="With --engine vllm: the most requests the front holds while vLLM is down; past it, 503 with "
         "Retry-After.")]
MaxResumes = Annotated[int, _option(
    "--max-resumes", panel=SUPERVISION,
    help="With --engine vllm: a request the engine died under this many times in a row, with no token coming "
         "out, is not resumed again (a poison request) but fails with a clear error.")]
LogFormatOpt = Annotated[LogFormat, _option(
    "--log-format", case_sensitive=False,
    help="Console output: auto (coloured text on a TTY, plain text otherwise), text or json.")]


def _load_config(ctx, param, value):
    if value is None:  # click calls back without a file too; the loader stays unimported
        return value
    from vsup.cli.config_file import load_into_context

    return load_into_context(ctx, param, value)


Config = Annotated[Optional[str], _option(
    "--config", metavar="FILE", show_default=False, is_eager=True, callback=_load_config,
    help="Read option values from a TOML (.toml) or YAML (.yaml, .yml) file whose keys are long option names "
         "(tensor-parallel-size or tensor_parallel_size; model for MODEL). Flags and VSUP_* variables win over "
         "the file; plan skips the keys only serve takes.")]

# what `logs`, `restart` and `stop` select

Role = Annotated[Optional[str], _option(
    "--role", show_default=False,
    help="api-server, engine-core, worker, coordinator; with --engine vllm also front (logs: also supervisor, "
         "and helper with --engine vllm).")]
DpRank = Annotated[Optional[int], _option("--dp", show_default=False, help="Only this data-parallel rank.")]
PpRank = Annotated[Optional[int], _option("--pp", show_default=False, help="Only this pipeline stage.")]
TpRank = Annotated[Optional[int], _option("--tp", show_default=False, help="Only this tensor-parallel rank.")]
ReplicaIndex = Annotated[Optional[int], _option(
    "--replica", show_default=False, help="Only this vLLM replica (of --replicas; `r1` is 1).")]
Rolling = Annotated[bool, _option(
    "--rolling", help="Every vLLM replica in turn (or the one of --replica): each is drained (the front sends "
                      "it nothing new), restarted, and serving again before the next one goes.")]
Level = Annotated[Optional[str], _option(
    "--level", show_default=False, help="This level and above: debug, info, warning, error.")]
Since = Annotated[Optional[str], _option(
    "--since", show_default=False, help="Lines from the last 30s, 10m, 2h, 1d, or since an ISO time.")]
Lines = Annotated[Optional[int], _option("-n", "--lines", show_default=False, help="Only the last N matching lines.")]
Follow = Annotated[bool, _option("-f", "--follow", help="Keep printing new lines as they come.")]
StopWait = Annotated[float, _option("--timeout", envvar="VSUP_STOP_WAIT",
                                    help="Seconds `vsup stop` waits for the tree to end.")]
Watch = Annotated[bool, _option("-w", "--watch", help="Refresh in place until Ctrl-C, like top.")]
Now = Annotated[bool, _option("--now", help="Restart at once, the way a crash would, without draining first.")]
Flat = Annotated[bool, _option("--flat", help="One table row per process instead of the tree (no load column).")]
Interval = Annotated[float, _option("--interval", help="Seconds between refreshes with --watch.")]

K8s = Annotated[bool, _option(
    "--k8s", panel=K8S,
    help="Print the Kubernetes manifests of this plan as YAML: a Deployment and a Service on one node; a "
         "LeaderWorkerSet (one pod per node) and a Service of its leaders on more. Every container runs "
         "`vsup serve` with these flags; nothing of this machine is read.")]
Image = Annotated[Optional[str], _option(
    "--image", panel=K8S, show_default=False,
    help="The container image (with vsup, and vLLM for --engine vllm).  [default: vsup:cpu or vsup:cuda, "
         "built from the Containerfile]")]
Namespace = Annotated[str, _option("--namespace", panel=K8S, help="The namespace of every object.")]
Groups = Annotated[int, _option(
    "--groups", panel=K8S,
    help="How many copies of the whole deployment: the Deployment's replicas, or the LeaderWorkerSet's "
         "groups (--replicas stays vsup's own: vLLM trees inside one pod).")]
ModelPvc = Annotated[Optional[str], _option(
    "--model-pvc", panel=K8S, show_default=False,
    help="A PersistentVolumeClaim that holds the model, mounted read-only at /models: give MODEL as "
         "/models/...")]
ModelHostPath = Annotated[Optional[str], _option(
    "--model-host-path", panel=K8S, show_default=False,
    help="A directory of each node that holds the model, mounted read-only at /models: give MODEL as "
         "/models/...")]
PodCpus = Annotated[Optional[str], _option(
    "--pod-cpus", panel=K8S, show_default=False,
    help="CPU per pod, as Kubernetes spells it (8, 7500m).  [default: a core per worker, and one for the rest]")]
PodMemory = Annotated[Optional[str], _option(
    "--pod-memory", panel=K8S, show_default=False,
    help="Memory per pod (32Gi).  [default: from the plan's arithmetic when MODEL is readable here, else "
         "4Gi per worker and 1Gi per other process]")]
