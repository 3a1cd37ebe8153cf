"""`python -m vsup.front`: what the supervisor starts as the `front` process of a stock vLLM deployment.

The keys travel in the environment, never in argv: VSUP_API_KEY (what clients
must give) and VSUP_FRONT_UPSTREAM_KEY (vLLM's private one).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket

PR_SET_PDEATHSIG = 1


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m vsup.front",
                                     description="Every value comes from `vsup serve`, which has the defaults.")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, action="append",
                        help="the Unix socket vLLM serves on, once per replica (in replica order)")
    parser.add_argument("--resume-timeout", type=float, required=True)
    parser.add_argument("--max-pending", type=int, required=True)
    parser.add_argument("--max-resumes", type=int, required=True)
    parser.add_argument("--drain-timeout", type=float, required=True)
    parser.add_argument("--listen-fd", type=int, help="serve on this inherited socket, bound to --host and --port "
                        "by the supervisor, which holds it (default: bind them here)")
    parser.add_argument("--cpus", help="the cores to run on (off vLLM's workers' cores)")
    parser.add_argument("--keepalive", type=float, default=10.0,
                        help="seconds of silence after which a stream is sent an SSE comment (default 10)")
    args = parser.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        import setproctitle
        setproctitle.setproctitle("vsup::front")
    except ImportError:
        pass

    import uvicorn

    from vsup.front.app import Front, log

    front = Front(args.upstream, os.environ.get("VSUP_FRONT_UPSTREAM_KEY"), os.environ.get("VSUP_API_KEY"),
                  args.resume_timeout, args.max_pending, args.max_resumes, args.keepalive)
    config = uvicorn.Config(front, host=args.host, port=args.port, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=args.drain_timeout,
                            timeout_keep_alive=30, backlog=2048, loop="uvloop", http="httptools")
    server = uvicorn.Server(config)
    log("listening", host=args.host, port=args.port, upstreams=args.upstream)
    server.run(sockets=None if args.listen_fd is None else [socket.socket(fileno=args.listen_fd)])


if __name__ == "__main__":
    main()
