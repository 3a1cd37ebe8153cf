"""What devices this node has, found without importing torch."""

from __future__ import annotations

import os

from vsup.errors import UsageError

NVIDIA_PROC = "/proc/driver/nvidia/gpus"


def visible_gpu_count() -> int:
    """GPUs a child process would see: CUDA_VISIBLE_DEVICES when set, else the driver's count."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if os.path.isdir(NVIDIA_PROC):
        return len(os.listdir(NVIDIA_PROC))
    out = _nvidia_smi("-L")
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _nvidia_smi(*args: str) -> str:
    """nvidia-smi's output, or "" where it is missing or fails."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return ""
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def gpu_memory_bytes() -> int | None:
    """Total memory of the first visible GPU, or None when nvidia-smi cannot tell."""
    out = _nvidia_smi("--query-gpu=memory.total", "--format=csv,noheader,nounits")
    try:
        return int(out.split()[0]) * 2**20
    except (ValueError, IndexError):
        return None


def gpu_processes() -> list[dict]:
    """Every process holding memory on a GPU this node sees: {"pid", "gpu" (its cuda:N index as the
    deployment numbers them), "bytes"}; [] where nvidia-smi cannot tell."""
    gpus = _nvidia_smi("--query-gpu=index,uuid", "--format=csv,noheader")
    if not gpus:
        return []
    apps = _nvidia_smi("--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits")
    return parse_gpu_processes(gpus, apps, os.environ.get("CUDA_VISIBLE_DEVICES"))


def parse_gpu_processes(gpus_csv: str, apps_csv: str, visible: str | None = None) -> list[dict]:
    """nvidia-smi's GPUs (index, uuid) and compute apps (pid, gpu uuid, MiB) as `gpu_processes` gives them;
    with CUDA_VISIBLE_DEVICES (`visible`: indices or uuids), the index is the position in it, and GPUs
    outside it are left out."""
    physical = {}
    for line in gpus_csv.splitlines():
        index, _, uuid = (part.strip() for part in line.partition(","))
        if index.isdigit():
            physical[uuid] = int(index)
    order = [v.strip() for v in visible.split(",")] if visible else None
    found = []
    for line in apps_csv.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in physical:
            continue
        gpu = physical[parts[1]]
        if order is not None:
            position = next((i for i, v in enumerate(order) if v in (str(gpu), parts[1])), None)
            if position is None:
                continue
            gpu = position
        mib = int(parts[2]) if parts[2].isdigit() else 0
        found.append({"pid": int(parts[0]), "gpu": gpu, "bytes": mib * 2**20})
    return found


def resolve_device(device: str) -> str:
    """`auto` becomes cuda when a GPU is visible, else cpu."""
    if device == "auto":
        return "cuda" if visible_gpu_count() > 0 else "cpu"
    return device


def check_devices(device: str, needed: int) -> None:
    """Refuse a plan that needs more GPUs on this node than are visible."""
    if device != "cuda":
        return
    visible = visible_gpu_count()
    if needed > visible:
        raise UsageError(
            f"--device cuda: this node needs {needed} GPUs (dp-size-local x tp x pp) but {visible} "
            f"{'is' if visible == 1 else 'are'} visible; lower -tp/-pp/-dp or --dp-size-local, "
            f"or use --device cpu")


def cpu_shares(allowed: list[int], num_workers: int) -> list[list[int]]:
    """Each CPU worker's own cores: `allowed` split into equal runs, one per worker, in order
    (the rest unused); [] for everyone when there are fewer cores than workers (no pinning)."""
    share = len(allowed) // num_workers if num_workers else 0
    if share < 1:
        return [[] for _ in range(num_workers)]
    cores = sorted(allowed)
    return [cores[i * share:(i + 1) * share] for i in range(num_workers)]
