"""The CPU kernels of engine/ops/csrc, built once per machine and loaded as `torch.ops.vsup_cpu`.

They are compiled with the C++ compiler on first use (about 35 s on two cores, with torch's cpp_extension
and ninja), for this CPU (-march=native), into torch's extension cache (TORCH_EXTENSIONS_DIR,
else ~/.cache/torch_extensions), where later processes find them in milliseconds;
`make install` builds them ahead (`python -m engine.ops.cpu_extension`). Where the build fails
(no compiler, no ninja), `load()` says why once in the log and returns False, as it does
under VSUP_CPU_KERNELS=0; the callers then keep their plain-torch path, which computes the same
values up to float rounding.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sysconfig
from pathlib import Path

import structlog
import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
# -fno-trapping-math lets the loops with a comparison or a float-to-int conversion vectorize (FP
# exceptions are never read); -fopenmp: parallel_for runs on torch's own OpenMP runtime
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]

log = structlog.get_logger(__name__)


def enabled() -> bool:
    return os.environ.get("VSUP_CPU_KERNELS", "1") != "0"


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def _name() -> str:
    """Changes with the sources, the flags, torch's version and the CPU (a build for another CPU's
    instructions would crash here, not fail)."""
    digest = hashlib.sha256()
    sources = [p.read_text() for p in sorted([*SOURCES, *CSRC.glob("*.h")])]
    for part in [torch.__version__, platform.machine(), _cpu_flags(), *FLAGS, *sources]:
        digest.update(part.encode())
    return f"vsup_cpu_{digest.hexdigest()[:12]}"


def _put_ninja_on_path() -> None:
    """pip's ninja (a dependency, beside this Python) first on the PATH, whatever else is there: every
    process must build with the same ninja. Another version hashes the build commands otherwise (here
    the system's 1.11 and pip's 1.13), so each process that found the other one rebuilt the whole
    extension: make test's workers rebuilt it over and over, each holding the rest up for a build."""
    scripts = sysconfig.get_path("scripts")
    if scripts and os.path.exists(os.path.join(scripts, "ninja")):
        path = os.environ.get("PATH", "").split(os.pathsep)
        if path[:1] != [scripts]:
            os.environ["PATH"] = os.pathsep.join([scripts, *path])


@functools.cache
def load() -> bool:
    """Build (first time on this machine) and load the kernels; False where they cannot be had."""
    if not enabled():
        return False
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()

        cpp_extension.load(name=_name(), sources=[str(p) for p in SOURCES], extra_cflags=FLAGS,
                           extra_ldflags=["-fopenmp"], is_python_module=False)
        return True
    except Exception as error:  # no compiler, no ninja, a failed build: the torch path stays
        log.warning("the CPU kernels of engine/ops/csrc could not be built; using plain torch", error=str(error))
        return False


def is_available(tensor: torch.Tensor) -> bool:
    """True when the kernels can take `tensor`: float32 on the CPU, and they loaded."""
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and load()


def takes_rows(tensor: torch.Tensor) -> bool:
    """True when the norms, SiLU and the argmax can take `tensor`'s rows: float32 ones (`is_available`), or
    the bfloat16 output of a bfloat16 linear or LM head (--linear-dtype bfloat16), which they read as it is."""
    if tensor.dtype == torch.bfloat16:
        return tensor.device.type == "cpu" and load()
    return is_available(tensor)


if __name__ == "__main__":  # `make install`: build now rather than in a worker's first step
    print("engine/ops CPU kernels:", "ready" if load() else "not built (plain torch is used)")
