"""A stand-in for an engine process: says ready like one, writes to fd 2 like C code, then waits.

FAKE_CRASH=PREFIX makes the processes whose name starts with it die at startup with a traceback, every time.
FAKE_LINGER=PREFIX=SECONDS,... makes those take that long to exit on SIGTERM.
"""

import json
import os
import signal
import sys
import time

from engine.process import become

name = become("fake")
if os.environ.get("FAKE_CRASH") and name.startswith(os.environ["FAKE_CRASH"]):
    print("loading shard 0 of 1", file=sys.stderr, flush=True)
    raise RuntimeError(f"{name}: CUDA error: out of memory (simulated)")


def say(event, **fields):
    print(json.dumps({"event": event, "level": "info", "timestamp": "2026-01-01T00:00:00Z", **fields}), flush=True)


os.write(2, f"native write from {name}\n".encode())  # what C code printing to stderr looks like
try:
    {}["missing"]
except KeyError:
    import traceback
    traceback.print_exc()  # a traceback on stderr, not through the logger
say("ready", role="liar", dp=99)  # the pipe's tag must win over what the child claims
linger = dict(item.split("=") for item in os.environ.get("FAKE_LINGER", "").split(",") if item)
linger_s = next((float(s) for prefix, s in linger.items() if name.startswith(prefix)), 0.0)
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(linger_s), sys.exit(0)))
while True:
    time.sleep(1)
