"""`python -m engine.api_server`: argv, the listening socket, and uvicorn.

    python -m engine.api_server --api-server-rank 0 --api-server-count 2 --data-parallel-size 2 \
        --model DIR --served-model-name NAME --host 127.0.0.1 --port 8000 \
        --engine-address ipc://RUN/a0-engines.sock [--api-key KEY] [--max-model-len L] [--no-multiprocessing]

Several API servers share one port. Under vsup they serve one socket that
the supervisor bound and holds (--listen-fd): a connection waiting to be
accepted is taken by whichever is free, and outlives the death of any one
of them. Started by hand, each binds its own with SO_REUSEPORT and the
kernel spreads connections across them (and resets those waiting for one
that dies). Flags meant for other roles pass through untouched.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket

import structlog

from engine.args import add_parallel_sizes, add_structured_output_limits, role_parser

BACKLOG = 2048
JOIN_POLL_S = 0.05  # a sibling API server looks this often whether an engine core is ready

ENV_API_KEY = "VSUP_API_KEY"
ENV_MULTIPROCESSING = "VSUP_ENABLE_MULTIPROCESSING"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This role's flags; the flags of other roles pass through."""
    p = role_parser("engine.api_server", "One API server of a vsup tree.")
    p.add_argument("--api-server-rank", type=int, default=0)
    p.add_argument("--api-server-count", type=int, default=1)
    add_parallel_sizes(p)
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", nargs="+", default=None, help="the name(s) clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--listen-fd", type=int, default=None,
                   help="serve on this inherited socket, bound to --host and --port by the supervisor (default: "
                        "bind them here)")
    p.add_argument("--engine-address", default=None, help="the ROUTER this API server binds for its engine cores")
    p.add_argument("--api-key", default=os.environ.get(ENV_API_KEY) or None, help=f"or ${ENV_API_KEY}")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-request-body-bytes", type=int, default=8 << 20)
    add_structured_output_limits(p)
    p.add_argument("--engine-heartbeat-timeout", type=float, default=5.0,
                   help="seconds without a word after which a core no longer counts as up")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="on SIGTERM, how long open requests may finish")
    p.add_argument("--disable-access-log", action="store_true")
    p.add_argument("--coordinator-address", default=None, help="every DP rank's load, from the coordinator (DP > 1)")
    p.add_argument("--worker-address", default=None, help="in-process mode, TP x PP > 1: where workers connect")
    p.add_argument("--ring-prefix", default=None, help="in-process mode, TP x PP > 1: the step ring's name prefix")
    p.add_argument("--wakeup-address", default=None, help="in-process mode, TP x PP > 1: the ring's wakeup socket")
    p.add_argument("--supervisor-socket", default=None,
                   help="the supervisor's control socket: what each process is busy with, for /metrics")
    p.add_argument("--metrics-dir", default=None,
                   help="a directory that every API server of the deployment shares: /metrics sums their counters "
                        "and histograms, those of API servers that restarted included")
    p.add_argument("--state-file", default=None,
                   help="the supervisor's state.json: restarts per role for /metrics, ranks it gave up on for /health")
    p.add_argument("--no-multiprocessing", dest="multiprocessing", action="store_false",
                   default=os.environ.get(ENV_MULTIPROCESSING, "1") != "0",
                   help=f"run the engine core and its worker in this process (or ${ENV_MULTIPROCESSING}=0)")
    # the in-process engine's flags (the same spelling the engine core and worker take)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--linear-dtype", default=None)
    p.add_argument("--kv-cache-dtype", default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=2**30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--dp-lockstep", action="store_true", help="DP ranks step together (part of the fingerprint)")
    args, _unknown = p.parse_known_args(argv)
    if args.multiprocessing and not args.engine_address:
        p.error("--engine-address is required (or run in-process with --no-multiprocessing)")
    if not args.multiprocessing and (args.data_parallel_size, args.api_server_count) != (1, 1):
        p.error("--no-multiprocessing runs one engine core inside one API server: it needs DP = 1 and "
                "--api-server-count 1")
    if not args.multiprocessing and args.tensor_parallel_size * args.pipeline_parallel_size > 1 and not (
            args.worker_address and args.ring_prefix and args.wakeup_address):
        p.error("--no-multiprocessing with TP x PP > 1 needs --worker-address, --ring-prefix and --wakeup-address "
                "for its worker processes (vsup serve passes them)")
    return args


def listen_socket(host: str, port: int, reuse_port: bool, listen: bool = True) -> socket.socket:
    """A bound TCP socket (IPv6 if `host` is one), listening unless told not to yet; SO_REUSEPORT lets
    sibling API servers share the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def build(args: argparse.Namespace, before_serving=None, on_fatal=None):
    """The app for these args: tokenizer, engine client (ZeroMQ or in-process, which calls `on_fatal(error)`
    once its core is gone), metrics."""
    from engine.api_server.app import build_app
    from engine.api_server.metrics import Metrics
    from engine.api_server.serving import Serving
    from engine.api_server.tokenizer import Tokenizer
    from engine.model.config import ModelConfig

    model_config = ModelConfig.from_pretrained(args.model)
    if args.multiprocessing:
        from engine import cluster
        from engine.api_server.engine_client import EngineClient
        client = EngineClient(args.engine_address, args.data_parallel_size,
                              heartbeat_timeout_s=args.engine_heartbeat_timeout,
                              coordinator_address=args.coordinator_address,
                              fingerprint=cluster.fingerprint_of(args, args.api_server_count))
    else:
        from engine.api_server.inproc_client import InprocClient, InprocConfig
        client = InprocClient(InprocConfig(
            model=args.model, device=args.device, dtype=args.dtype, linear_dtype=args.linear_dtype,
            kv_cache_dtype=args.kv_cache_dtype, kv_cache_bytes=args.kv_cache_bytes,
            block_size=args.block_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
            num_threads=args.num_threads, tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size, worker_address=args.worker_address,
            ring_prefix=args.ring_prefix, wakeup_address=args.wakeup_address,
            grammar_compile_timeout=args.grammar_compile_timeout, max_grammar_bytes=args.max_grammar_bytes),
            on_fatal=on_fatal)
    metrics = Metrics(client, state_file=args.state_file, supervisor_socket=args.supervisor_socket,
                      shared_dir=args.metrics_dir)
    serving = Serving(client, Tokenizer.from_dir(args.model), served_model_names=args.served_model_name or [args.model],
                      max_model_len=args.max_model_len or model_config.max_model_len,
                      vocab_size=model_config.vocab_size, metrics=metrics, max_grammar_bytes=args.max_grammar_bytes)
    return build_app(serving, metrics=metrics, api_key=args.api_key, max_body_bytes=args.max_request_body_bytes,
                     api_server_rank=args.api_server_rank, state_file=args.state_file,
                     before_serving=before_serving)


def main(argv: list[str] | None = None) -> int:
    """Become `api-server a<rank>`, build the app, serve until SIGTERM or SIGINT."""
    from engine.log import configure
    from engine.process import become, freeze_heap

    args = parse_args(argv)
    if args.metrics_dir:  # prometheus_client reads it once, when imported (engine/api_server/metrics.py)
        os.makedirs(args.metrics_dir, mode=0o700, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = args.metrics_dir
    become(f"api-server a{args.api_server_rank}")
    log = configure("api-server", a=args.api_server_rank)
    if args.model is None:
        from engine.model.default_model import default_model_dir
        args.model = str(default_model_dir())
    import uvicorn

    # "ready" is the event the supervisor waits for, and means that a request gets served: said once an
    # engine core can take requests (in-process, the engine thread says it). A sibling of other API
    # servers on one port also takes connections only then: it would answer them 503 until its cores
    # said Ready, while its siblings could serve them. So does one alone on the supervisor's socket when
    # that socket listened before (a restart): connections wait in its queue, and are served a moment
    # later. Alone at the start, it listens at once and answers /health "starting" meanwhile.
    if args.listen_fd is not None:
        sock = socket.socket(fileno=args.listen_fd)
        restarted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        join_later = args.multiprocessing and (args.api_server_count > 1 or restarted)
    else:
        join_later = args.multiprocessing and args.api_server_count > 1
        sock = listen_socket(args.host, args.port, reuse_port=args.api_server_count > 1, listen=not join_later)

    def say_ready() -> None:
        freeze_heap()
        log.info("ready" if args.multiprocessing else "listening", host=args.host, port=sock.getsockname()[1],
                 multiprocessing=args.multiprocessing, api_key=bool(args.api_key))

    async def until_a_core_is_ready(client) -> bool:
        while not client.is_ready():
            if server.should_exit:  # stopped before any core came: uvicorn shuts down after startup
                return False
            await asyncio.sleep(JOIN_POLL_S)
        return True

    async def join_the_port(client) -> None:
        if await until_a_core_is_ready(client):
            sock.listen(BACKLOG)
            say_ready()

    announcing = set()  # (a reference to the task, which the event loop holds only weakly)

    async def announce_when_ready(client) -> None:
        async def announce():
            if await until_a_core_is_ready(client):
                say_ready()
        announcing.add(asyncio.get_running_loop().create_task(announce()))

    failed = []

    def end_without_a_core(error: str) -> None:
        # in-process, this process is the engine core: without one it serves nothing again, so it ends, and
        # its supervisor starts it again (with its backoff and start limit) as it would a core process
        log.error("no engine core is left in this process: exiting", error=error)
        failed.append(error)
        server.should_exit = True

    if not args.multiprocessing:
        say_ready()
    app = build(args, before_serving=join_the_port if join_later else
                announce_when_ready if args.multiprocessing else None, on_fatal=end_without_a_core)
    config = uvicorn.Config(app, log_config=None, access_log=not args.disable_access_log,
                            timeout_graceful_shutdown=args.drain_timeout, lifespan="on",
                            loop="asyncio", http="h11")  # (measure_event_loop times asyncio's selector)
    server = uvicorn.Server(config)
    # uvicorn turns SIGTERM/SIGINT into a graceful shutdown, then raises the signal again with the
    # handlers it found: found a no-op, a requested stop ends with exit code 0, as the other roles do
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    if failed:
        return 1
    structlog.get_logger("api-server").info("stopped")
    return 0
