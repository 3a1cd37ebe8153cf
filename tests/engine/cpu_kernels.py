"""What the CPU kernel tests share: when they run, and a spy that says a kernel ran.

Where a C++ compiler exists the kernels must build: a build that broke fails these tests
rather than skipping them (the engine itself falls back to torch, so nothing else would notice).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine.ops import cpu_extension


@pytest.fixture(autouse=True)
def built():
    """Skip where the kernels cannot be had (no compiler, VSUP_CPU_KERNELS=0); fail where they should build."""
    if not cpu_extension.enabled():
        pytest.skip("VSUP_CPU_KERNELS=0")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here: the CPU kernels cannot be built")
    assert cpu_extension.load(), "the CPU kernels of engine/ops/csrc did not build (the log says why)"


def spy(monkeypatch, op: str) -> list[str]:
    """Calls of torch.ops.vsup_cpu.<op> from now on, one entry each."""
    calls: list[str] = []
    real = getattr(torch.ops.vsup_cpu, op)
    monkeypatch.setattr(torch.ops.vsup_cpu, op, lambda *args: calls.append(op) or real(*args))
    return calls
