"""A stand-in for NVML (nvidia-ml-py) at vsup's boundary, for a host without a GPU: one 80 GiB GPU whose
holders, [[pid, bytes], ...], are read from the JSON file FAKE_NVML_HOLDERS at each call."""

import json
import os
from types import SimpleNamespace


class NVMLError(Exception):
    pass


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return 1


def nvmlDeviceGetHandleByIndex(index):
    return index


def nvmlDeviceGetUUID(handle):
    return "GPU-fake-0"


def nvmlDeviceGetComputeRunningProcesses(handle):
    with open(os.environ["FAKE_NVML_HOLDERS"]) as f:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in json.load(f)]


def nvmlDeviceGetPciInfo(handle):
    return SimpleNamespace(busId="00000000:00:00.0")


def nvmlDeviceGetMemoryInfo(handle):
    return SimpleNamespace(total=80 << 30)
