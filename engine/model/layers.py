"""The building blocks of a Llama-family decoder, sharded for tensor parallelism.

Every layer with weights has `load_weight(name, loaded, shard_id=0)`, where
`loaded` is a safetensors slice (or a tensor: both index the same way), so
each rank reads only the rows or columns it keeps. Parameters are allocated
uninitialized: the loader fills them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import ParallelGroups
from engine.model.config import RopeScaling
from engine.ops import cpu_extension, cpu_linear


def _shape(loaded) -> tuple[int, ...]:
    return tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)


def _check_shape(loaded, expected: tuple[int, ...], what: str) -> None:
    if _shape(loaded) != expected:
        raise ValueError(f"checkpoint tensor for {what} has shape {list(_shape(loaded))}, but config.json "
                         f"implies {list(expected)}; the checkpoint and its config.json disagree")


def _empty(groups: ParallelGroups, dtype: torch.dtype, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=groups.device), requires_grad=False)


class RMSNorm(nn.Module):
    """RMS norm, computed in float32 as transformers does; with `residual`
    it first adds it and returns (normed, new residual). On the CPU (float32) that add and the
    norm are one kernel that writes both into x and residual, which the caller hands over; x may
    be a bfloat16 linear's output (`native`, below), and the normed rows are then bfloat16, what
    the next such linear takes."""

    def __init__(self, size: int, eps: float, groups: ParallelGroups, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = _empty(groups, dtype, size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if (residual is not None and cpu_extension.takes_rows(x) and cpu_extension.is_available(residual)
                and x.dim() == residual.dim() == 2 and x.stride(-1) == residual.stride(-1) == 1):
            torch.ops.vsup_cpu.add_rms_norm_(x, residual, self.weight, self.eps)  # both in place, one pass
            return x, residual
        if residual is not None:
            x = residual = residual + x
        if x.dtype == torch.float32:  # one fused kernel, 1.1-2x the ops below (batch 16-300, 2 cores)
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        else:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)

    def load_weight(self, name: str, loaded, shard_id: int = 0) -> None:
        _check_shape(loaded, tuple(self.weight.shape), "a norm weight")
        self.weight.data.copy_(loaded[:])


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The rotary frequencies, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slow down by `factor`, short ones stay, the band between is blended
    old_len = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over a precomputed cos/sin table; the
    model looks up each step's rows once, for all its layers."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None,
                 groups: ParallelGroups, dtype: torch.dtype):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos().to(dtype=dtype, device=groups.device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype=dtype, device=groups.device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D / 2] of each token's position, for `rotate`: looked up once a step,
        not once a layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, heads, D] rotated by `RotaryEmbedding(positions)`: the query and key heads of a layer
    go through in one call (half the small ops of two calls). On the CPU (float32), in place."""
    cos, sin = rope
    if cpu_extension.is_available(x):  # in place, one pass
        torch.ops.vsup_cpu.rotary_(x, cos.squeeze(1), sin.squeeze(1))
        return x
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _out_dtype(linear: ColumnParallelLinear | RowParallelLinear, native: bool) -> torch.dtype:
    """The model's dtype; with `native`, the one the linear computes in where it has no bias (its packed
    weight's: bfloat16 under --linear-dtype bfloat16), for a next op that takes that as it is (the norms,
    SiLU, another such linear), sparing a cast each way, as engine/ops/csrc/decoder_stack.cpp does."""
    if native and linear.packed is not None and linear.bias is None:
        return linear.packed.dtype
    return linear.weight.dtype


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows: each TP rank computes its
    slice of the output, no communication. `output_sizes` lists the full
    sizes of fused parts (q, k, v or gate, up); each part is split on its own,
    so a rank's weight is [q_r; k_r; v_r], loaded part by part (`shard_id`)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 groups: ParallelGroups, dtype: torch.dtype):
        super().__init__()
        tp = groups.tp_size
        if any(size % tp for size in output_sizes):
            raise ValueError(f"output sizes {output_sizes} do not split over tensor parallel size {tp}")
        self.tp_rank = groups.tp_rank
        self.input_size = input_size
        self.output_sizes = output_sizes
        self.shard_sizes = [size // tp for size in output_sizes]
        self.weight = _empty(groups, dtype, sum(self.shard_sizes), input_size)
        self.bias = _empty(groups, dtype, sum(self.shard_sizes)) if bias else None
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout (engine/ops/cpu_linear.py)

    def forward(self, x: torch.Tensor, native: bool = False) -> torch.Tensor:
        return cpu_linear.linear(x, self.weight, self.packed, self.bias, _out_dtype(self, native))

    def load_weight(self, name: str, loaded, shard_id: int = 0) -> None:
        size = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        start = self.tp_rank * size
        full = (self.output_sizes[shard_id],) + ((self.input_size,) if name == "weight" else ())
        _check_shape(loaded, full, f"part {shard_id} of a column-parallel {name}")
        getattr(self, name).data[offset:offset + size].copy_(loaded[start:start + size])


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns: each TP rank multiplies
    its slice of x, the partial sums are all-reduced, then the bias is added
    once (every rank holds all of it)."""

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 groups: ParallelGroups, dtype: torch.dtype):
        super().__init__()
        if input_size % groups.tp_size:
            raise ValueError(f"input size {input_size} does not split over tensor parallel size {groups.tp_size}")
        self.groups = groups
        self.input_size, self.output_size = input_size, output_size
        self.shard_size = input_size // groups.tp_size
        self.weight = _empty(groups, dtype, output_size, self.shard_size)
        self.bias = _empty(groups, dtype, output_size) if bias else None
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout (engine/ops/cpu_linear.py)

    def forward(self, x: torch.Tensor, native: bool = False) -> torch.Tensor:
        if self.groups.tp_size == 1:
            return cpu_linear.linear(x, self.weight, self.packed, self.bias, _out_dtype(self, native))
        # the partial sums are added up in the model's dtype
        y = self.groups.all_reduce(cpu_linear.linear(x, self.weight, self.packed, out_dtype=self.weight.dtype))
        return y if self.bias is None else y + self.bias

    def load_weight(self, name: str, loaded, shard_id: int = 0) -> None:
        if name == "bias":
            _check_shape(loaded, (self.output_size,), "a row-parallel bias")
            self.bias.data.copy_(loaded[:])
            return
        _check_shape(loaded, (self.output_size, self.input_size), "a row-parallel weight")
        start = self.groups.tp_rank * self.shard_size
        self.weight.data.copy_(loaded[:, start:start + self.shard_size])


class VocabParallelEmbedding(nn.Module):
    """Token embedding split by vocabulary rows: rank r holds ids
    [r * n, (r + 1) * n) with n = ceil(vocab / tp) (the last shard padded with
    zero rows); ids outside a rank's range look up zeros, and an all-reduce
    sums the one rank that has each id."""

    def __init__(self, vocab_size: int, hidden_size: int, groups: ParallelGroups, dtype: torch.dtype):
        super().__init__()
        self.groups = groups
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.shard_size = -(-vocab_size // groups.tp_size)
        self.vocab_start = groups.tp_rank * self.shard_size
        self.weight = _empty(groups, dtype, self.shard_size, hidden_size)
        self.packed: torch.Tensor | None = None  # as an LM head: the weight in oneDNN's layout

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.groups.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.groups.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def load_weight(self, name: str, loaded, shard_id: int = 0) -> None:
        _check_shape(loaded, (self.vocab_size, self.hidden_size), "the embedding or LM head")
        num_rows = max(0, min(self.shard_size, self.vocab_size - self.vocab_start))
        self.weight.data[:num_rows].copy_(loaded[self.vocab_start:self.vocab_start + num_rows])
        self.weight.data[num_rows:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary rows like the embedding
    (so a tied head can share its weight); logits are gathered on TP rank 0."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits [N, vocab] on TP rank 0; None on other ranks. In the head's own dtype: a
        bfloat16 head under a float32 model (--linear-dtype bfloat16) gives bfloat16 logits as oneDNN wrote
        them, not widened (the samplers widen what they compute on; greedy reads them as they are)."""
        out_dtype = None if self.packed is None else self.packed.dtype
        logits = self.groups.gather(cpu_linear.linear(hidden, self.weight, self.packed, out_dtype=out_dtype), dim=-1)
        return None if logits is None else logits[..., :self.vocab_size]
