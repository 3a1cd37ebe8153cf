"""Run the real supervisor over a tree of stand-in processes: python tree.py NAME TP DP MAX_RESTARTS.

With FAKE_NVML_HOLDERS set, the plan's workers are on CUDA and NVML is the stand-in of fake/nvml (the one
thing faked: what the driver says of who holds GPU memory)."""

import dataclasses
import os
import sys

from vsup.cli.serve import supervise
from vsup.rundir import RunDir
from vsup.supervisor.supervisor import Options
from vsup.supervisor.restart_policy import RestartPolicy
from vsup.topology import ParallelConfig, plan

CHILD = __file__.replace("tree.py", "child.py")


def fake_plan(tp: int, dp: int, device: str = "cpu"):
    real = plan(ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, device=device))
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
    device = "cpu"
    if os.environ.get("FAKE_NVML_HOLDERS"):
        from vsup import devices

        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "nvml"))  # (its pynvml first)
        devices.NVIDIA_CTL, device = "/dev/null", "cuda"  # (a driver's device node: any file that exists)
    if os.environ.get("FAKE_PROBE_PORT"):  # as `vsup serve --probe-port` binds it
        from vsup.cli.serve import bind_port

        options.probe_socket = bind_port("127.0.0.1", int(os.environ["FAKE_PROBE_PORT"]), "--probe-port")
    code, message = supervise(fake_plan(tp, dp, device), run_dir, options, "text")
    if code:
        print(f"vsup serve: {message}", file=sys.stderr)
    sys.exit(code)
