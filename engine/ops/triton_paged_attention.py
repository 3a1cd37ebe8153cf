"""Decode attention over a paged KV cache: a Triton kernel and its torch reference.

Cache layout per layer: key_cache and value_cache [num_blocks, block_size,
num_kv_heads, head_dim]; row i of `block_tables` lists the cache blocks of
sequence i in order. Decode only: one query token per sequence, whose K/V
are already in the cache, so `seq_lens` counts it.

One program handles one (sequence, KV head) and all the query heads that
share that KV head (GQA), so each K/V block is read once per group; it walks
the sequence's blocks with an online softmax. The module imports without
triton or a GPU; `is_available()` says whether the kernel can run here.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except Exception as error:  # ImportError, or a broken install failing at import
    triton = None
    _IMPORT_ERROR: str | None = f"triton cannot be imported: {error}"
else:
    _IMPORT_ERROR = None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run in this process, or None when it can."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        return None
    return "no CUDA device (set TRITON_INTERPRET=1 before importing triton to run on CPU)"


def is_available() -> bool:
    """True when `paged_attention_decode` can run: a GPU, or the Triton interpreter."""
    return unavailable_reason() is None


if triton is not None:

    @triton.jit
    def _paged_attention_decode_kernel(
        out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
        scale_log2,
        stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
        stride_k_block, stride_k_token, stride_k_head,
        stride_v_block, stride_v_token, stride_v_head,
        stride_bt_seq,
        QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        PADDED_QUERIES: tl.constexpr, PADDED_DIM: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + seq)

        groups = tl.arange(0, PADDED_QUERIES)
        dims = tl.arange(0, PADDED_DIM)
        tokens = tl.arange(0, BLOCK_SIZE)
        group_mask = groups < QUERIES_PER_KV
        dim_mask = dims < HEAD_DIM
        heads = kv_head * QUERIES_PER_KV + groups

        q_offsets = seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :]
        q_mask = group_mask[:, None] & dim_mask[None, :]
        query = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)

        # running max (log2 domain), softmax denominator and weighted sum per query head
        running_max = tl.full([PADDED_QUERIES], float("-inf"), dtype=tl.float32)
        denominator = tl.zeros([PADDED_QUERIES], dtype=tl.float32)
        acc = tl.zeros([PADDED_QUERIES, PADDED_DIM], dtype=tl.float32)

        num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
        for logical_block in range(0, num_blocks):
            block = tl.load(block_tables_ptr + seq * stride_bt_seq + logical_block).to(tl.int64)
            positions = logical_block * BLOCK_SIZE + tokens
            token_mask = positions < seq_len
            kv_mask = token_mask[:, None] & dim_mask[None, :]
            k_offsets = (block * stride_k_block + tokens[:, None] * stride_k_token
                         + kv_head * stride_k_head + dims[None, :])
            key = tl.load(key_cache_ptr + k_offsets, mask=kv_mask, other=0.0).to(tl.float32)
            v_offsets = (block * stride_v_block + tokens[:, None] * stride_v_token
                         + kv_head * stride_v_head + dims[None, :])
            value = tl.load(value_cache_ptr + v_offsets, mask=kv_mask, other=0.0).to(tl.float32)

            # [queries, tokens]: a broadcast product, since tl.dot needs every dim >= 16
            scores = tl.sum(query[:, None, :] * key[None, :, :], axis=2) * scale_log2
            scores = tl.where(token_mask[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            correction = tl.exp2(running_max - new_max)
            weights = tl.exp2(scores - new_max[:, None])
            denominator = denominator * correction + tl.sum(weights, axis=1)
            acc = acc * correction[:, None] + tl.sum(weights[:, :, None] * value[None, :, :], axis=1)
            running_max = new_max

        # seq_len 0 (a padding row) leaves the denominator 0: write zeros, not nan
        out = acc / tl.where(denominator > 0, denominator, 1.0)[:, None]
        o_offsets = seq * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_shapes(query, key_cache, value_cache, block_tables, seq_lens) -> None:
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache "
                         f"{tuple(value_cache.shape)} must have the same shape")
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and seq_lens "
                         f"{tuple(seq_lens.shape)} must have {num_seqs} rows")


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context, with the Triton kernel.

    query [num_seqs, num_heads, head_dim]; caches [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables int32 [num_seqs, max_blocks_per_seq];
    seq_lens [num_seqs], context lengths including the current token.
    Returns (or fills `out`) [num_seqs, num_heads, head_dim] in query's dtype.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the Triton paged-attention kernel cannot run: {reason}")
    _check_shapes(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    # the kernel walks the head dim and the block table contiguously
    query = query if query.stride(-1) == 1 else query.contiguous()
    key_cache = key_cache if key_cache.stride(-1) == 1 else key_cache.contiguous()
    value_cache = value_cache if value_cache.stride(-1) == 1 else value_cache.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    if out is None:
        out = torch.empty_like(query)
    queries_per_kv = num_heads // num_kv_heads
    _paged_attention_decode_kernel[(num_seqs, num_kv_heads)](
        out, query, key_cache, value_cache, block_tables, seq_lens,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        PADDED_QUERIES=triton.next_power_of_2(queries_per_kv),
        PADDED_DIM=triton.next_power_of_2(head_dim),
    )
    return out


def paged_attention_decode_reference(query: torch.Tensor, key_cache: torch.Tensor,
                                     value_cache: torch.Tensor, block_tables: torch.Tensor,
                                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention in plain torch (float32 math), for tests and as a CPU fallback.

    Gathers every sequence's blocks into a padded [num_seqs, max_len, ...]
    context and masks positions at or past its length.
    """
    _check_shapes(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    tables = block_tables.long()
    max_len = tables.shape[1] * block_size
    keys = key_cache[tables].reshape(num_seqs, max_len, num_kv_heads, head_dim).float()
    values = value_cache[tables].reshape(num_seqs, max_len, num_kv_heads, head_dim).float()
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=2)
    values = values.repeat_interleave(group, dim=2)

    scores = torch.einsum("shd,sthd->sht", query.float(), keys) * scale
    positions = torch.arange(max_len, device=query.device)
    is_past_end = positions[None, :] >= seq_lens.to(query.device).long()[:, None]
    scores = scores.masked_fill(is_past_end[:, None, :], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(dim=-1))  # an empty row gives zeros, as the kernel
    return torch.einsum("sht,sthd->shd", probs, values).to(query.dtype)
