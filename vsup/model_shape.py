"""The shape of a model, read from its Hugging Face config.json (no torch).

engine/model/config.py is the one reader of config.json; this is vsup's view
of what it read, with errors a user can fix as UsageErrors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from engine.model.config import ModelConfig
from vsup.errors import UsageError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelShape(ModelConfig):
    """What the planner needs to know of a Llama-family decoder: the engine's ModelConfig, and a name."""

    name: str = "model"

    @classmethod
    def from_config(cls, config: dict, name: str = "model", strict: bool = True) -> ModelShape:
        """`strict`: a model our engine runs; else any decoder whose shape reads like a Llama's (for
        --engine vllm, which runs more architectures than ours)."""
        try:
            c = ModelConfig.from_dict(config, strict=strict)
        except KeyError as e:
            raise UsageError(f"MODEL: config.json lacks a usable {e} field; is this a Llama-family model?") from None
        except (TypeError, ValueError) as e:
            raise UsageError(f"MODEL: config.json: {e}") from None
        return cls(**{f.name: getattr(c, f.name) for f in fields(ModelConfig)}, name=name)

    def check_parallel(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """Refuse TP that does not split the heads and the MLP evenly, or PP with more stages than layers."""
        tp = tensor_parallel_size
        sizes = (self.num_heads, self.num_kv_heads, self.intermediate_size)
        if any(size % tp for size in sizes):
            choices = [d for d in range(1, self.num_kv_heads + 1) if not any(size % d for size in sizes)]
            raise UsageError(
                f"-tp/--tensor-parallel-size {tp} does not divide the model's {self.num_heads} attention heads "
                f"and {self.num_kv_heads} KV heads; use -tp {' or '.join(map(str, choices))}")
        if pipeline_parallel_size > self.num_layers:
            raise UsageError(
                f"-pp/--pipeline-parallel-size {pipeline_parallel_size} exceeds the model's {self.num_layers} "
                f"layers; use at most -pp {self.num_layers}")


def read_model_shape(path: str | Path, strict: bool = True) -> ModelShape:
    """Read MODEL's config.json; a path that is not a model directory is a usage error."""
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"MODEL {str(path)!r} is not a directory; give a local Hugging Face model directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UsageError(f"MODEL {str(path)!r} has no config.json; give a local Hugging Face model directory")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"MODEL {str(path)!r}: config.json cannot be read ({e})") from None
    if not isinstance(config, dict):
        raise UsageError(f"MODEL {str(path)!r}: config.json is not a JSON object")
    return ModelShape.from_config(config, name=path.name, strict=strict)
