"""Memory arithmetic for a plan: weights per worker, KV bytes per token, token capacity.

Pure functions of the model's shape and the flags; the device's size comes in
as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vsup.errors import UsageError
from vsup.sizes import format_bytes

if TYPE_CHECKING:  # (model_shape reads engine's config)
    from vsup.model_shape import ModelShape

DEFAULT_CPU_KV_CACHE_BYTES = 2**30  # like vLLM's CPU KV cache space: a fixed size, not a fraction of RAM

def layer_ranges(num_layers: int, pipeline_parallel_size: int) -> list[range]:
    """Contiguous layer ranges per pipeline stage; the first stages take the remainder."""
    base, extra = divmod(num_layers, pipeline_parallel_size)
    ranges, start = [], 0
    for stage in range(pipeline_parallel_size):
        size = base + (stage < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def resolve_dtype(dtype: str, shape: ModelShape, device: str) -> str:
    """`auto` is the model's own dtype on CUDA and float32 on the CPU (see `cpu_auto_parts` for its parts)."""
    if dtype == "auto":
        return shape.dtype if device == "cuda" else "float32"
    from vsup.model_shape import DTYPE_BYTES

    if dtype not in DTYPE_BYTES:
        raise UsageError(f"--dtype must be auto, {', '.join(DTYPE_BYTES)} (got {dtype!r})")
    return dtype


def cpu_auto_parts(dtype: str, device: str, auto_bfloat16: bool, linear_dtype: str, kv_cache_dtype: str
                   ) -> tuple[str, str]:
    """(--linear-dtype, --kv-cache-dtype) with `auto` worked out: under --dtype auto on a CPU that computes
    bfloat16 (`auto_bfloat16`), a float32 model's linears and KV cache are bfloat16, as vLLM-CPU runs a float32
    model in bfloat16 there (our norms, rotary and attention stay float32); elsewhere auto is --dtype's."""
    if dtype == "auto" and device == "cpu" and auto_bfloat16:
        return (("bfloat16" if linear_dtype == "auto" else linear_dtype),
                ("bfloat16" if kv_cache_dtype == "auto" else kv_cache_dtype))
    return linear_dtype, kv_cache_dtype


def _part_in_other_dtype(flag: str, value: str, dtype: str, device: str, does: str) -> str | None:
    """`value` of `flag` (a part of a float32 model on the CPU in another dtype) where it applies, or None
    when it is auto or `dtype` itself. `does`: what the part does in `value`, for the message."""
    if value in ("auto", dtype):
        return None
    if device != "cpu":
        raise UsageError(f"{flag} {value} is for the CPU; on CUDA give --dtype {value}")
    if dtype != "float32":
        raise UsageError(f"{flag} {value} {does} {value}: give --dtype float32 with it, or leave it out")
    return value


def resolve_linear_dtype(linear_dtype: str, dtype: str, device: str, cpu_bfloat16: bool) -> str | None:
    """`--linear-dtype` where it applies, or None when the linears compute in `dtype` (auto). `dtype`:
    resolved; `cpu_bfloat16`: whether this CPU computes bfloat16 (avx512_bf16 or AMX)."""
    does = "runs a float32 model's linears in"
    if _part_in_other_dtype("--linear-dtype", linear_dtype, dtype, device, does) is None:
        return None
    if not cpu_bfloat16:
        raise UsageError(f"--linear-dtype {linear_dtype} needs a CPU with avx512_bf16 or AMX (without them bfloat16 "
                         f"is slower than float32 here): leave it out")
    return linear_dtype


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str, device: str) -> str | None:
    """`--kv-cache-dtype` where it applies, or None when the cache stores `dtype` (auto). `dtype`: resolved."""
    return _part_in_other_dtype("--kv-cache-dtype", kv_cache_dtype, dtype, device,
                                "stores a float32 model's K and V in")


def worker_weight_bytes(shape: ModelShape, tp: int, pp: int, stage: int, dtype_bytes: int,
                        linear_bytes: int | None = None) -> int:
    """Bytes of weights one worker of `stage` holds: its layers' TP slices, plus the
    vocab-parallel embedding on the first stage and the head on the last. `linear_bytes`:
    what a weight of the linears and the head takes when it differs (--linear-dtype)."""
    linear_bytes = linear_bytes or dtype_bytes
    h, hd = shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * hd, shape.num_kv_heads * hd
    linears = (h * (q + 2 * kv) + q * h + 3 * h * shape.intermediate_size) // tp
    others = 2 * h  # the norms
    if shape.attention_bias:
        others += (q + 2 * kv) // tp
    if shape.o_proj_bias:
        others += h  # a row-parallel bias is whole on every rank
    layers = len(layer_ranges(shape.num_layers, pp)[stage])
    total = layers * (linears * linear_bytes + others * dtype_bytes)
    embedding = shape.vocab_size * h // tp
    if stage == 0:
        total += embedding * dtype_bytes
    if stage == pp - 1:
        total += h * dtype_bytes  # final norm
        if not (shape.tie_word_embeddings and pp == 1):
            total += embedding * linear_bytes  # the head (a copy of the embedding when tied across stages)
    return total


def kv_bytes_per_token(shape: ModelShape, tp: int, num_layers: int, dtype_bytes: int) -> int:
    """Key and value bytes one token takes in one worker's slice of the cache."""
    return 2 * num_layers * (shape.num_kv_heads // tp) * shape.head_dim * dtype_bytes


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: range
    weight_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int

    @property
    def tokens(self) -> int:
        return self.kv_cache_bytes // self.kv_bytes_per_token


@dataclass(frozen=True)
class MemoryPlan:
    """Per-stage figures (every TP rank of a stage holds the same) and the capacity per DP rank."""

    dtype: str
    stages: tuple[StageMemory, ...]
    linear_dtype: str | None = None  # the linears' and the head's, where it is not `dtype`
    kv_cache_dtype: str | None = None  # the KV cache's, where it is not `dtype`

    @property
    def tokens_per_dp_rank(self) -> int:
        return min(s.tokens for s in self.stages)

    @property
    def kv_bytes_per_token(self) -> int:
        """Summed over the whole worker group: what one token costs a DP rank."""
        return sum(s.kv_bytes_per_token for s in self.stages)


def memory_plan(shape: ModelShape, *, tp: int, pp: int, dtype: str, device: str,
                device_bytes: int | None, kv_cache_memory: int | None,
                gpu_memory_utilization: float, max_model_len: int | None,
                linear_dtype: str = "auto", cpu_bfloat16: bool = False, kv_cache_dtype: str = "auto",
                auto_bfloat16: bool = False) -> MemoryPlan:
    """Work out what each worker holds, or raise a "won't fit" UsageError saying by how much.

    `device_bytes` is one worker's share of its device: a GPU's memory, or the
    node's RAM divided among its workers; None when it cannot be known.
    `cpu_bfloat16`: whether this CPU computes bfloat16 (for `linear_dtype`); `auto_bfloat16`: whether --dtype
    auto gives the linears and KV cache bfloat16 (`cpu_auto_parts`). The flags' values were checked before
    (vsup/cli/sizing.py's check_values).
    """
    linear_dtype, kv_cache_dtype = cpu_auto_parts(dtype, device, auto_bfloat16, linear_dtype, kv_cache_dtype)
    dtype = resolve_dtype(dtype, shape, device)
    linear_dtype = resolve_linear_dtype(linear_dtype, dtype, device, cpu_bfloat16)
    kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, device)
    from vsup.model_shape import DTYPE_BYTES

    nbytes = DTYPE_BYTES[dtype]
    linear_bytes = DTYPE_BYTES[linear_dtype or dtype]
    kv_bytes = DTYPE_BYTES[kv_cache_dtype or dtype]
    usable = None if device_bytes is None else int(device_bytes * (gpu_memory_utilization if device == "cuda" else 1))
    stages = []
    for stage, layers in enumerate(layer_ranges(shape.num_layers, pp)):
        weights = worker_weight_bytes(shape, tp, pp, stage, nbytes, linear_bytes)
        if usable is not None and weights > usable:
            raise UsageError(
                f"won't fit: a worker of stage pp{stage} needs {format_bytes(weights)} of weights but has "
                f"{format_bytes(usable)}; short by {format_bytes(weights - usable)}. Raise -tp or -pp")
        if kv_cache_memory is not None:
            kv_cache = kv_cache_memory
        elif device == "cuda" and usable is not None:
            kv_cache = usable - weights
        else:
            kv_cache = DEFAULT_CPU_KV_CACHE_BYTES
        if usable is not None and weights + kv_cache > usable:
            raise UsageError(
                f"won't fit: a worker of stage pp{stage} needs {format_bytes(weights)} of weights plus "
                f"{format_bytes(kv_cache)} of KV cache but has {format_bytes(usable)}; short by "
                f"{format_bytes(weights + kv_cache - usable)}. Lower --kv-cache-memory or raise -tp/-pp")
        stages.append(StageMemory(stage, layers, weights, kv_bytes_per_token(shape, tp, len(layers), kv_bytes),
                                  kv_cache))
    result = MemoryPlan(dtype, tuple(stages), linear_dtype, kv_cache_dtype)
    needed = max_model_len or shape.max_position_embeddings
    if result.tokens_per_dp_rank < needed:
        short = needed - result.tokens_per_dp_rank
        worst = max(result.stages, key=lambda s: s.kv_bytes_per_token)
        raise UsageError(
            f"won't fit: the KV cache holds {result.tokens_per_dp_rank:,} tokens per DP rank but one request of "
            f"--max-model-len {needed:,} needs {needed:,}; short by {short:,} tokens "
            f"({format_bytes(short * worst.kv_bytes_per_token)} per worker). Raise --kv-cache-memory or "
            f"--gpu-memory-utilization, or lower --max-model-len")
    return result
