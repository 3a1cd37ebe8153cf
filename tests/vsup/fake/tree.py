"""Run the real supervisor over a tree of stand-in processes: python tree.py NAME SHAPE [--max-restarts N]."""

import dataclasses
import sys

from vsup.cli.serve import supervise
from vsup.rundir import RunDir
from vsup.supervisor.supervisor import Options
from vsup.supervisor.restart_policy import RestartPolicy
from vsup.topology import ParallelConfig, plan

CHILD = __file__.replace("tree.py", "child.py")


def fake_plan(tp: int, dp: int):
    real = plan(ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp))
    return dataclasses.replace(real, processes=tuple(dataclasses.replace(p, argv=(sys.executable, CHILD))
                                                     for p in real.processes))


if __name__ == "__main__":
    name, tp, dp, max_restarts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    run_dir = RunDir(name)
    run_dir.create()
    run_dir.lock()
    options = Options(model="fake", url="http://127.0.0.1:1",
                      restart_policy=RestartPolicy("on-failure", max_restarts=max_restarts),
                      startup_timeout=60, drain_timeout=5, stop_timeout=5)
    code, message = supervise(fake_plan(tp, dp), run_dir, options, "text")
    if code:
        print(f"vsup serve: {message}", file=sys.stderr)
    sys.exit(code)
