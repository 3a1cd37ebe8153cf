"""Fill one rank's model from a local Hugging Face directory of safetensors.

Each rank opens the files itself and reads, through `get_slice`, only the
rows or columns of only the tensors it holds: a pipeline stage never touches
another stage's layers, a TP rank never materializes a whole matrix.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.distributed import ParallelGroups
from engine.model.config import ModelConfig
from engine.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from engine.model.llama import LlamaForCausalLM
from engine.ops import cpu_linear
from engine.progress import Progress

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (one file, or many
    listed in model.safetensors.index.json)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(model_dir)!r} has no *.safetensors file; vsup loads safetensors checkpoints only "
                         f"(convert .bin or GGUF weights with save_pretrained(..., safe_serialization=True))")
    names = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update((name, file) for name in f.keys())
    return names


def load_weights(model: LlamaForCausalLM, model_dir: str | Path,
                 progress: Progress | None = None) -> dict[str, tuple[int, ...]]:
    """Copy this rank's slices of the checkpoint into `model`, converting to
    its dtype. Returns, for each tensor read, the shape of what was read
    (the shard, not the full tensor). Raises ValueError when a tensor this
    rank needs is missing. `progress(done, total)` hears of every tensor."""
    plan = model.checkpoint_weights()
    files = checkpoint_files(model_dir)
    missing = sorted(name for name in plan if name not in files)
    if missing:
        raise ValueError(f"the checkpoint in {str(model_dir)!r} lacks {len(missing)} tensors the model needs "
                         f"(first: {missing[0]}); does config.json describe these weights?")
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in plan:
        by_file[files[name]].append(name)
    read: dict[str, tuple[int, ...]] = {}
    for file, names in sorted(by_file.items()):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                for module, param, shard_id in plan[name]:
                    reader = _RecordingSlice(f.get_slice(name))
                    module.load_weight(param, reader, shard_id)
                    read[name] = reader.shape_read
                if progress is not None:
                    progress(len(read), len(plan))
    return read


def load_model(model_dir: str | Path, groups: ParallelGroups | None = None, dtype: str | None = None,
               config: ModelConfig | None = None, progress: Progress | None = None,
               linear_dtype: str | None = None) -> LlamaForCausalLM:
    """Build this rank's shard of the model in `model_dir` and load it.
    `dtype` (float32, float16, bfloat16, or None/"auto" for the checkpoint's)
    may differ from the files': tensors are converted as they are copied.
    `linear_dtype` (bfloat16 under a float32 model on a CPU that computes it):
    the dtype the linear layers and the LM head compute in."""
    config = config or ModelConfig.from_pretrained(model_dir, dtype=dtype)
    model = LlamaForCausalLM(config, groups)
    load_weights(model, model_dir, progress)
    pack_linears(model, linear_dtype)
    return model.eval()


def pack_linears(model: nn.Module, linear_dtype: str | None = None) -> None:
    """On the CPU in float32 (and bfloat16 where the CPU computes it), every linear layer and the LM
    head run from a oneDNN-packed copy of the weight (engine/ops/cpu_linear.py), in `linear_dtype`
    if given; the dense copy is freed unless something else uses it (a tied head's weight is the
    embedding's)."""
    dtype = getattr(torch, linear_dtype) if linear_dtype else None
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))]
    if dtype is not None and model.dtype != torch.float32:
        raise ValueError(f"--linear-dtype {linear_dtype} is for a float32 model (--dtype float32), not {model.dtype}")
    if dtype is not None and not all(cpu_linear.enabled(m.weight, dtype) for m in linears):
        raise ValueError(f"--linear-dtype {linear_dtype} needs packed linears: the CPU device, a CPU that computes "
                         f"it (avx512_bf16 or AMX for bfloat16) and VSUP_PACKED_LINEAR not 0; leave it out here")
    shared = {id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)
              and not isinstance(m, ParallelLMHead)}
    for module in linears:
        if cpu_linear.enabled(module.weight, dtype):
            module.packed = cpu_linear.pack(module.weight, dtype)
            if id(module.weight) not in shared:
                module.weight.data = module.weight.data.new_empty(0)


class _RecordingSlice:
    """A safetensors slice that remembers the shape of what was read through it."""

    def __init__(self, sliced):
        self._slice = sliced
        self.shape_read: tuple[int, ...] = ()

    def get_shape(self) -> list[int]:
        return self._slice.get_shape()

    def __getitem__(self, index) -> torch.Tensor:
        tensor = self._slice[index]
        self.shape_read = tuple(tensor.shape)
        return tensor
