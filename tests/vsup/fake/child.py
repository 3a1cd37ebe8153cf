"""A stand-in for an engine process: says ready like one, writes to fd 2 like C code, then waits.

FAKE_CRASH=PREFIX makes the processes whose name starts with it die at startup with a traceback, every time.
FAKE_LINGER=PREFIX=SECONDS,... makes those take that long to exit on SIGTERM.
FAKE_QUIET=PREFIX=SECONDS,... makes those start that long, in silence, before they say ready.

Once ready, each dies as a test asks: SIGUSR1 segfaults it (a NULL read through ctypes), SIGUSR2 makes it
raise (writing a stand-in flight recorder dump first where TORCH_FR_DUMP_TEMP_FILE is set), SIGTTIN makes it
allocate memory until something stops it (the OOM killer, in a test's cgroup).
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


def seconds(variable: str) -> float:
    """This process's figure in `variable` (PREFIX=SECONDS,...): 0 when no prefix is its name's."""
    pairs = dict(item.split("=") for item in os.environ.get(variable, "").split(",") if item)
    return next((float(s) for prefix, s in pairs.items() if name.startswith(prefix)), 0.0)


os.write(2, f"native write from {name}\n".encode())  # what C code printing to stderr looks like
try:
    {}["missing"]
except KeyError:
    import traceback
    traceback.print_exc()  # a traceback on stderr, not through the logger
time.sleep(seconds("FAKE_QUIET"))
say("ready", role="liar", dp=99)  # the pipe's tag must win over what the child claims
linger_s = seconds("FAKE_LINGER")
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(linger_s), sys.exit(0)))


def segfault(*_):
    import ctypes

    ctypes.string_at(0)


def fail(*_):
    if os.environ.get("TORCH_FR_DUMP_TEMP_FILE"):  # (as torch's watchdog dumps the flight recorder, rank appended)
        with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + "0", "w") as f:  # (what it was given, for the test)
            json.dump({k: v for k, v in os.environ.items() if k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}, f)
    raise RuntimeError(f"{name}: CUDA error: an illegal memory access was encountered (simulated)")


hog = []
signal.signal(signal.SIGUSR1, segfault)
signal.signal(signal.SIGUSR2, fail)
signal.signal(signal.SIGTTIN, lambda *_: hog.append(b""))
while True:
    if hog:
        hog.append(bytearray(16 << 20))  # (zeroed: every page touched)
        time.sleep(0.005)
    else:
        time.sleep(0.2)
