"""What the CUDA tests share: they skip without a GPU (they fail instead under VSUP_REQUIRE_CUDA=1, as
tools/gpu_check.sh runs them), the model they serve, and the figures they write for the report.

Run here, every test of tests/gpu skips; tools/gpu_check.sh runs them on a lent GPU host.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

REQUIRE = "VSUP_REQUIRE_CUDA"  # 1: no GPU is a failure, not a skip
MODEL = "VSUP_GPU_CHECK_MODEL"  # the model tests/gpu/model.py built, when the check built it already
OUT = "VSUP_GPU_CHECK_OUT"  # where figures go: the check's output folder


@pytest.fixture(scope="session", autouse=True)
def cuda():
    """Session-scoped, so that it decides before any module's fixture starts a server."""
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{REQUIRE}=1 but torch.cuda.is_available() is False (torch {torch.__version__}, "
                    f"built for CUDA {torch.version.cuda}): no usable GPU here")
    pytest.skip("needs a CUDA device; tools/gpu_check.sh runs these on a GPU host")


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory) -> Path:
    """The directory of tests/gpu/model.py's model: the check's, or one built now."""
    if os.environ.get(MODEL):
        return Path(os.environ[MODEL])
    from tests.gpu.model import build

    return build(tmp_path_factory.mktemp("gpu-model"))


@pytest.fixture(scope="session")
def figures():
    """figures(name, data): write data as <name>.json into the check's output folder (if any); returns it."""
    def write(name: str, data):
        if os.environ.get(OUT):
            path = Path(os.environ[OUT]) / f"{name}.json"
            path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        print(f"{name}: {json.dumps(data, default=str)[:2000]}")
        return data
    return write
