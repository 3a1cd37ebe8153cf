"""Model directories for tests of what `vsup plan` and `vsup serve` accept, without torch or real weights.

`header_only_model` writes config.json, a tokenizer.json and a model.safetensors whose header lists every
tensor config.json describes while its data is a hole in a sparse file: a SmolLM2-sized model in a few
kilobytes of disk, which vsup's checks (vsup/model_dir.py, headers only) accept like the real one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from engine.model.config import ModelConfig

TOKENIZER = {"version": "1.0", "model": {"type": "WordLevel", "vocab": {"<unk>": 0}, "unk_token": "<unk>"}}


def header_only_model(path: Path, hf_config: dict, dtype: str = "BF16") -> Path:
    """A complete-looking model directory at `path` for this config.json (see the module's docstring)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    (path / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    shapes = ModelConfig.from_dict(hf_config, strict=False).checkpoint_shapes()
    write_safetensors_header(path / "model.safetensors", shapes, dtype)
    return path


def write_safetensors_header(file: Path, shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> None:
    """A safetensors file of these tensors, all zeros, written as a header and a hole."""
    size = {"F32": 4, "BF16": 2, "F16": 2}[dtype]
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    with open(file, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)
