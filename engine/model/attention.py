"""Paged attention: write new K/V into cache blocks, then attend over each sequence's blocks.

In plain torch, except where engine/ops has a kernel: on the CPU (float32) the K/V write and
decode attention (engine/ops/csrc, which reads the blocks in place), on CUDA decode attention
(Triton). The torch code stays as their fallback and the reference they are tested against.

The caches may hold bfloat16 under a float32 model (--kv-cache-dtype bfloat16): K/V are rounded
as they are written and widened as they are read, and attention computes in the model's dtype, except
that decode attention rounds the query to bfloat16 for its dots with K (products of bfloat16 numbers,
summed in float32), as the CPU kernel's bfloat16 dot product takes it.

Cache layout, per layer: key and value caches of shape
[num_blocks, block_size, num_kv_heads // tp, head_dim]. Token j of a sequence
lives in slot block_table[j // block_size] * block_size + j % block_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache, cached_property

import numpy as np
import torch
import torch.nn.functional as F

from engine.distributed import ParallelGroups, layer_range
from engine.model.config import ModelConfig
from engine.ops import cpu_extension


@dataclass
class AttentionMetadata:
    """Where one step's tokens go and what they attend to.

    Tokens of all sequences are packed: sequence i owns query rows
    query_start_loc[i]:query_start_loc[i + 1], which are its last tokens, so
    a chunk that starts after cached tokens is causal with offset
    seq_lens[i] - query_len.
    """

    slot_mapping: torch.Tensor  # long [num_tokens]: flat cache slot of each new token's K/V
    query_start_loc: torch.Tensor  # long [num_seqs + 1]
    seq_lens: torch.Tensor  # long [num_seqs]: context after this step, cached + new
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    max_seq_len: int
    is_decode_only: bool
    _scratch: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, num_cached: list[int], num_new: list[int], block_tables: list[list[int]],
              block_size: int, device: str | torch.device = "cpu") -> AttentionMetadata:
        """Metadata for sequences that have `num_cached[i]` tokens in the cache
        and add `num_new[i]` this step, stored in blocks `block_tables[i]`."""
        slots, starts, lens = [], [0], []
        for cached, new, table in zip(num_cached, num_new, block_tables, strict=True):
            if len(table) * block_size < cached + new:
                raise ValueError(f"{len(table)} blocks of {block_size} cannot hold {cached + new} tokens")
            slots += [table[j // block_size] * block_size + j % block_size for j in range(cached, cached + new)]
            starts.append(starts[-1] + new)
            lens.append(cached + new)
        width = max((len(t) for t in block_tables), default=0)
        tables = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.long, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device).view(len(tables), width),
            max_seq_len=max(lens, default=0),
            is_decode_only=all(n == 1 for n in num_new),
        )

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def scratch(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A buffer that every layer of this step reuses: on CPU a fresh
        allocation of this size per layer costs more in page faults than the
        copy into it (measured: 6 ms against 1 ms for 12 MB)."""
        buf = self._scratch.get(name)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._scratch[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf

    # read once per step on the host, not once per layer
    @cached_property
    def host_query_start_loc(self) -> list[int]:
        return self.query_start_loc.tolist()

    @cached_property
    def host_seq_lens(self) -> list[int]:
        return self.seq_lens.tolist()

    @cached_property
    def query_lens(self) -> list[int]:
        starts = self.host_query_start_loc
        return [end - start for start, end in zip(starts, starts[1:])]

    @cached_property
    def whole_prompts(self) -> dict[int, torch.Tensor]:
        """Sequences whose chunk is all of their context (a prompt with nothing cached) and longer than
        a token, by length: length -> their query rows, sequence after sequence [count * length]."""
        rows: dict[int, list[int]] = {}
        for start, n, seq_len in zip(self.host_query_start_loc, self.query_lens, self.host_seq_lens):
            if n == seq_len > 1:
                rows.setdefault(n, []).extend(range(start, start + n))
        return {n: torch.tensor(r, device=self.query_start_loc.device) for n, r in rows.items()}


def allocate_kv_caches(config: ModelConfig, groups: ParallelGroups, num_blocks: int, block_size: int,
                       dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (key, value) caches for each layer of this rank's stage."""
    layers = layer_range(config.num_layers, groups.pp_size, groups.pp_rank)
    shape = (num_blocks, block_size, config.num_kv_heads // groups.tp_size, config.head_dim)
    dtype = dtype or config.torch_dtype
    return [(_zeros(shape, dtype, groups.device), _zeros(shape, dtype, groups.device)) for _ in layers]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros (masked slots are read, and NaN * 0 is NaN). On the CPU from calloc'd pages, which the
    kernel maps to the zero page until first written: a 1 GiB cache costs nothing until used,
    instead of seconds of memset at every start and worker-group restart."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def kv_cache_block_bytes(config: ModelConfig, groups: ParallelGroups, block_size: int,
                         dtype: torch.dtype | None = None) -> int:
    """Bytes one block costs on this rank, keys and values of all its layers."""
    layers = layer_range(config.num_layers, groups.pp_size, groups.pp_rank)
    itemsize = (dtype or config.torch_dtype).itemsize
    return 2 * len(layers) * block_size * (config.num_kv_heads // groups.tp_size) * config.head_dim * itemsize


CPU_KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16)  # the caches engine/ops' CPU kernels read and write


def _kernels_take(rows: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether engine/ops' CPU kernels take these float32 rows (queries, or new K/V) with this cache."""
    return cpu_extension.is_available(rows) and cache.device.type == "cpu" and cache.dtype in CPU_KERNEL_CACHE_DTYPES


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new tokens' key/value [num_tokens, H_kv, D] at their slots (every slot must be valid)."""
    if _kernels_take(key, key_cache):
        torch.ops.vsup_cpu.write_kv(key, value, key_cache, value_cache, slot_mapping)
        return
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, key: torch.Tensor | None = None,
                    value: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each new token over its sequence's cached context.

    query: [num_tokens, num_heads, head_dim], packed as metadata.query_start_loc says.
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim],
    already holding this step's K/V (see `write_kv`); num_heads is a multiple
    of num_kv_heads (GQA: query head h reads KV head h // (num_heads // num_kv_heads)).
    Query row t of sequence i, at position seq_lens[i] - query_len + t, sees
    context positions 0 ..= that position. Returns [num_tokens, num_heads, head_dim].

    key, value: this step's K/V [num_tokens, H_kv, D], packed like query, when the caller has
    them: a prefill chunk with no cached context before it reads them instead of the cache.

    Any mix of prefill chunks and single-token decodes is served; prefill chunks in torch,
    decodes by engine/ops' CPU kernel where it loaded (else in torch); CUDA decode-only batches
    (power-of-two block size) go to engine/ops' Triton kernel.
    """
    block_size = key_cache.shape[1]
    if (query.is_cuda and metadata.is_decode_only and block_size & (block_size - 1) == 0
            and key_cache.dtype == query.dtype):
        kernel = _decode_kernel()
        if kernel is not None:
            return kernel(query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens, scale)
    if metadata.is_decode_only:
        return _decode_attention(query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                                 metadata.max_seq_len, scale, metadata)
    out = torch.empty_like(query)
    starts, lens, query_lens = metadata.host_query_start_loc, metadata.host_seq_lens, metadata.query_lens
    # the decodes of a mixed batch go in one batched call, whole prompts in one a length, other chunks one by one
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    if decodes:
        rows = metadata.query_start_loc[decodes]
        seqs = torch.tensor(decodes, device=query.device)
        out[rows] = _decode_attention(query[rows], key_cache, value_cache, metadata.block_tables[seqs],
                                      metadata.seq_lens[seqs], max(lens[i] for i in decodes), scale,
                                      metadata)
    whole = metadata.whole_prompts if key is not None else {}  # their K/V are this step's
    for n, rows in whole.items():
        picked = (x.index_select(0, rows) for x in (query, key, value))
        out.index_copy_(0, rows, _prompts_attention(n, *picked, scale))
    for i, n in enumerate(query_lens):
        if n > 1 and (n != lens[i] or key is None):  # (not one of `whole`: a chunk after cached tokens, or no K/V)
            start = starts[i]
            rows = slice(start, start + n)
            keys = _gather(key_cache, metadata.block_tables[i], lens[i]).to(query.dtype)
            values = _gather(value_cache, metadata.block_tables[i], lens[i]).to(query.dtype)
            out[rows] = _prefill_attention(query[rows], keys, values, scale)
    return out


@cache
def _decode_kernel():
    """engine/ops' Triton decode kernel, or None where it cannot run (no triton)."""
    from engine.ops import triton_paged_attention as ops
    return ops.paged_attention_decode if ops.is_available() else None


def _gather(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """The first `num_tokens` cached rows of the blocks in `block_table` ([nb] or [B, nb]),
    written into `out` ([*block_table.shape[:-1], nb * block_size, H, D]) when given."""
    num_blocks, block_size = cache.shape[:2]
    blocks = block_table[..., :-(-num_tokens // block_size)].long()
    flat_out = None if out is None else out.view(blocks.numel(), -1)
    # index_select on the 2-D view is a row memcpy; on the 4-D tensor it is several times slower
    rows = torch.index_select(cache.view(num_blocks, -1), 0, blocks.flatten(), out=flat_out)
    return rows.view(*blocks.shape[:-1], -1, *cache.shape[2:])[..., :num_tokens, :, :]


def _decode_attention(query, key_cache, value_cache, block_tables, seq_lens, max_len, scale, metadata):
    """One query token per sequence, batched: query [B, H, D] -> [B, H, D]. On the CPU, engine/ops'
    kernel reads the blocks in place; the gather and SDPA below are its fallback and reference."""
    if _kernels_take(query, key_cache) and key_cache.is_contiguous() and query.stride(-1) == 1:
        out = torch.empty(query.shape, dtype=query.dtype)
        torch.ops.vsup_cpu.paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, out)
        return out
    return _decode_attention_torch(query, key_cache, value_cache, block_tables, seq_lens, max_len, scale, metadata)


def _decode_attention_torch(query, key_cache, value_cache, block_tables, seq_lens, max_len, scale, metadata):
    """The plain-torch decode attention: each sequence's blocks gathered, then SDPA."""
    block_size = key_cache.shape[1]
    if key_cache.dtype == torch.bfloat16 and query.dtype == torch.float32:  # (as the kernel rounds the query)
        query = query.to(key_cache.dtype).to(query.dtype)
    shape = (query.shape[0], -(-max_len // block_size) * block_size, *key_cache.shape[2:])
    keys = _gather(key_cache, block_tables, max_len, metadata.scratch("keys", shape, key_cache)).to(query.dtype)
    values = _gather(value_cache, block_tables, max_len, metadata.scratch("values", shape, value_cache)).to(query.dtype)
    visible = torch.arange(max_len, device=query.device) < seq_lens.unsqueeze(1)  # [B, L]
    # SDPA's fused CPU kernel is 2-3x faster here than einsum + softmax (measured)
    out = F.scaled_dot_product_attention(query.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _prompts_attention(n, query, keys, values, scale):
    """Whole prompts of n tokens each, in one causal call: query [count * n, H, D] and their keys and
    values [count * n, H_kv, D], sequence after sequence (SDPA's per-call cost was most of a prefill
    step's attention when each short prompt had a call of its own)."""
    q, k, v = (x.view(-1, n, *x.shape[1:]).transpose(1, 2) for x in (query, keys, values))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(query.shape)


def _prefill_attention(query, keys, values, scale):
    """One sequence's chunk: query [n, H, D] over its context keys, values [L, H_kv, D], whose
    last n positions are the chunk's."""
    n, seq_len = query.shape[0], keys.shape[0]
    # batched 4-D, SDPA takes its flash kernel (3-D falls back to the math one: 1.5x the time)
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, keys, values))
    if n == seq_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # a chunk after cached tokens: row t sees positions <= seq_len - n + t
        visible = (torch.arange(seq_len, device=query.device)
                   <= torch.arange(n, device=query.device).unsqueeze(1) + (seq_len - n))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
