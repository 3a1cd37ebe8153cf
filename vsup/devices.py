"""What devices this node has, found without importing torch."""

from __future__ import annotations

import os
from dataclasses import dataclass

from vsup.cpulist import parse_cpu_list
from vsup.errors import UsageError

NVIDIA_PROC = "/proc/driver/nvidia/gpus"
NVIDIA_CTL = "/dev/nvidiactl"  # there wherever an NVIDIA driver can be used, containers included


def visible_gpu_count() -> int:
    """GPUs a child process would see: CUDA_VISIBLE_DEVICES when set, else the driver's count."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if os.path.isdir(NVIDIA_PROC):
        return len(os.listdir(NVIDIA_PROC))
    return len(nvml_gpus())


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML sees it: its physical index and uuid, its memory, and who holds memory on it."""

    index: int
    uuid: str
    total_bytes: int
    holders: tuple[tuple[int, int], ...] = ()  # (pid, bytes)
    numa: int = 0  # the NUMA node it is attached to


def nvml_gpus() -> list[Gpu]:
    """Every GPU of this node from NVML (nvidia-ml-py, imported only here); [] without a driver."""
    if not os.path.exists(NVIDIA_CTL):  # a CPU host: no import, no library search (vsup plan's start)
        return []
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            holders = tuple((p.pid, p.usedGpuMemory or 0)  # None where the driver may not say (some MIG, WSL)
                            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
            gpus.append(Gpu(index, uuid.decode() if isinstance(uuid, bytes) else uuid,
                            pynvml.nvmlDeviceGetMemoryInfo(handle).total, holders,
                            _pci_numa_node(bus.decode() if isinstance(bus, bytes) else bus)))
        return gpus
    except pynvml.NVMLError:
        return []
    finally:
        pynvml.nvmlShutdown()


def as_visible(gpus: list[Gpu], visible: str | None) -> list[Gpu]:
    """The GPUs a process with CUDA_VISIBLE_DEVICES=`visible` (indices or uuids, as CUDA reads it: up to
    the first entry it cannot use) sees, in its cuda:N order; all of them when unset."""
    if visible is None:
        return sorted(gpus, key=lambda g: g.index)
    seen = []
    for entry in (v.strip() for v in visible.split(",")):
        gpu = next((g for g in gpus if entry == str(g.index) or (entry.startswith("GPU-") and g.uuid.startswith(entry))),
                   None)
        if gpu is None or gpu in seen:
            break
        seen.append(gpu)
    return seen


def gpu_memory_bytes() -> int | None:
    """Total memory of the first GPU a child process would see, or None where NVML cannot tell."""
    gpus = as_visible(nvml_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    return gpus[0].total_bytes if gpus else None


def gpu_processes() -> list[dict]:
    """Every process holding memory on a GPU a child process would see: {"pid", "gpu" (its cuda:N index
    as the deployment numbers them), "bytes"}; [] where NVML cannot tell."""
    return holders(nvml_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))


def holders(gpus: list[Gpu], visible: str | None = None) -> list[dict]:
    """`gpu_processes` of these GPUs: GPUs outside `visible` are left out."""
    return [{"pid": pid, "gpu": n, "bytes": used}
            for n, gpu in enumerate(as_visible(gpus, visible)) for pid, used in gpu.holders]


def resolve_device(device: str) -> str:
    """`auto` becomes cuda when a GPU is visible, else cpu."""
    if device == "auto":
        return "cuda" if visible_gpu_count() > 0 else "cpu"
    return device


def check_devices(device: str, needed: int) -> None:
    """Refuse to serve a plan that needs more GPUs on this node than are visible."""
    short = devices_short(device, needed)
    if short:
        raise UsageError(f"--device cuda: {short}; lower -tp/-pp/-dp or --dp-size-local, or use --device cpu")


def devices_short(device: str, needed: int) -> str | None:
    """What this node lacks to run a plan's share (`plan` says it in a note; `serve` refuses), or None."""
    if device != "cuda":
        return None
    visible = visible_gpu_count()
    if needed <= visible:
        return None
    are = "is" if visible == 1 else "are"
    return f"this node needs {needed} GPUs (dp-size-local x tp x pp) but {visible} {are} visible"


def _pci_numa_node(bus_id: str) -> int:
    """The NUMA node of a PCI device (`00000000:3B:00.0` as NVML spells it); 0 where the kernel says none."""
    try:
        with open(f"/sys/bus/pci/devices/{bus_id[-12:].lower()}/numa_node") as f:
            return max(0, int(f.read()))
    except (OSError, ValueError):
        return 0


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has avx512_bf16 (AMX CPUs have it too): what the engine's bfloat16 linears need
    (torch.cpu._is_avx512_bf16_supported, without importing torch)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx512_bf16" in flags.split()


def this_machine(device: str):
    """The CPUs this process may use, this node's NUMA nodes, and (on CUDA) where its visible GPUs sit:
    a vsup.placement.Machine."""
    from vsup.placement import Machine

    cpus = tuple(sorted(os.sched_getaffinity(0)))
    numa = []
    for n in range(256):
        try:
            with open(f"/sys/devices/system/node/node{n}/cpulist") as f:
                numa.append(tuple(c for c in parse_cpu_list(f.read()) if c in cpus))
        except OSError:
            break
    gpus = as_visible(nvml_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES")) if device == "cuda" else []
    return Machine(cpus, tuple(numa) if len(numa) > 1 else (), tuple(g.numa for g in gpus))
