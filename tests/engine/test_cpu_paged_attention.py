"""engine/ops' CPU decode-attention kernel against the plain-torch path it replaces (gather + SDPA).

Ragged batches, contexts that end exactly at a block boundary or one token into a new block,
sequences that share their first blocks (prefix-cache hits), GQA groups, a query that is a view
of the fused qkv output, and both ways the kernel splits work (few sequences: by KV head). Each
with float32 caches and with bfloat16 ones (--kv-cache-dtype bfloat16), which both paths widen.
"""

from __future__ import annotations

import pytest
import torch

from engine.model import attention
from engine.model.attention import AttentionMetadata, paged_attention
from engine.ops import cpu_extension
from tests.engine.cpu_kernels import built, spy  # noqa: F401 (built: autouse)

BLOCK_SIZE = 16


def make_batch(seq_lens, num_heads=9, num_kv_heads=3, head_dim=64, shared_blocks=0, seed=0, block_size=BLOCK_SIZE,
               cache_dtype=torch.float32):
    """Random caches and block tables for sequences of `seq_lens` tokens (the last one this step's);
    the first `shared_blocks` blocks of every table are the same physical blocks."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + shared_blocks + sum(max(0, n - shared_blocks) for n in needed)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    free = (torch.randperm(num_blocks - 1 - shared_blocks, generator=gen) + 1 + shared_blocks).tolist()
    tables = [list(range(1, 1 + min(shared_blocks, n))) + [free.pop() for _ in range(max(0, n - shared_blocks))]
              for n in needed]
    metadata = AttentionMetadata.build([n - 1 for n in seq_lens], [1] * len(seq_lens), tables, block_size)
    # the query as the model has it: a view of the fused q/k/v projection, rows not contiguous
    qkv = torch.randn(len(seq_lens), num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return qkv[:, :num_heads], key_cache, value_cache, metadata


def kernel_and_torch(query, key_cache, value_cache, metadata, scale, vectorized=True):
    out = torch.empty(query.shape)
    torch.ops.vsup_cpu.paged_attention_decode(query, key_cache, value_cache, metadata.block_tables,
                                              metadata.seq_lens, scale, out, vectorized)
    expected = attention._decode_attention_torch(query, key_cache, value_cache, metadata.block_tables,
                                                 metadata.seq_lens, metadata.max_seq_len, scale, metadata)
    return out, expected


@pytest.mark.parametrize("seq_lens", [
    [1],  # the first token of a sequence
    [16], [17], [32], [33],  # a block filled exactly, one token into the next
    [5, 16, 17, 80, 1, 47],  # ragged
    list(range(1, 70, 3)),  # more sequences than threads: whole sequences per task
])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("vectorized", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_torch_path(seq_lens, heads, vectorized, cache_dtype):
    num_heads, num_kv_heads = heads
    query, key_cache, value_cache, metadata = make_batch(seq_lens, num_heads, num_kv_heads, cache_dtype=cache_dtype)
    out, expected = kernel_and_torch(query, key_cache, value_cache, metadata, 64 ** -0.5, vectorized)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shared_blocks", [1, 2])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_shared_prefix_blocks(shared_blocks, cache_dtype):
    """Prefix-cache hits: several sequences' tables start with the same physical blocks."""
    query, key_cache, value_cache, metadata = make_batch([33, 40, 48, 49, 64], shared_blocks=shared_blocks,
                                                         cache_dtype=cache_dtype)
    assert len({tuple(t[:shared_blocks]) for t in metadata.block_tables.tolist()}) == 1
    out, expected = kernel_and_torch(query, key_cache, value_cache, metadata, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("vectorized", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kernel_at_each_head_dim(head_dim, vectorized, cache_dtype):
    """64 and 128 have kernels of their own where the CPU has AVX-512 (16 tokens' dots summed across
    lanes together, their rows prefetched); other sizes, other CPUs and vectorized=False one dot at a
    time. Contexts end before, at and after a 16-token group, with a block size that is not 16."""
    query, key_cache, value_cache, metadata = make_batch([1, 15, 16, 17, 31, 32, 33, 100], 6, 2, head_dim,
                                                         block_size=8, cache_dtype=cache_dtype)
    out, expected = kernel_and_torch(query, key_cache, value_cache, metadata, head_dim ** -0.5, vectorized)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_kernel_handles_large_scores_and_an_odd_head_dim():
    """Scores far from 0 (the softmax subtracts its maximum) and a head_dim the vector lanes don't divide."""
    query, key_cache, value_cache, metadata = make_batch([3, 20, 41], num_heads=6, num_kv_heads=2, head_dim=40)
    out, expected = kernel_and_torch(query * 30, key_cache, value_cache, metadata, 40 ** -0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_an_empty_sequence_gives_zeros():
    query, key_cache, value_cache, metadata = make_batch([5, 9])
    metadata.seq_lens[1] = 0
    out = torch.full(query.shape, float("nan"))
    torch.ops.vsup_cpu.paged_attention_decode(query, key_cache, value_cache, metadata.block_tables,
                                              metadata.seq_lens, 0.125, out)
    assert out[1].eq(0).all() and not out[0].isnan().any()


def test_kernel_rejects_a_context_longer_than_its_table():
    query, key_cache, value_cache, metadata = make_batch([5, 9])
    metadata.seq_lens[0] = BLOCK_SIZE + 1
    with pytest.raises(RuntimeError, match="past its block table"):
        torch.ops.vsup_cpu.paged_attention_decode(query, key_cache, value_cache, metadata.block_tables,
                                                  metadata.seq_lens, 0.125, torch.empty(query.shape))


def test_paged_attention_takes_the_kernel_and_falls_back_without_it(monkeypatch):
    """paged_attention's decode path: the kernel, and without it the torch path, the same values."""
    query, key_cache, value_cache, metadata = make_batch([7, 16, 17, 30])
    calls = spy(monkeypatch, "paged_attention_decode")
    with_kernel = paged_attention(query, key_cache, value_cache, metadata, 0.125)
    assert calls == ["paged_attention_decode"]
    monkeypatch.setattr(cpu_extension, "is_available", lambda tensor: False)
    without = paged_attention(query, key_cache, value_cache, metadata, 0.125)
    torch.testing.assert_close(with_kernel, without, atol=1e-5, rtol=1e-5)


def test_caches_of_two_dtypes_are_refused():
    query, key_cache, value_cache, metadata = make_batch([5, 9])
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        torch.ops.vsup_cpu.paged_attention_decode(query, key_cache, value_cache.bfloat16(), metadata.block_tables,
                                                  metadata.seq_lens, 0.125, torch.empty(query.shape))


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "plain-torch"])
def test_a_bfloat16_cache_holds_rounded_rows_and_attends_close_to_float32(kernels, monkeypatch):
    """--kv-cache-dtype bfloat16: write_kv rounds each new row to nearest even, and a step's attention over
    the rounded context stays within bfloat16's precision of the float32 cache's."""
    if not kernels:
        monkeypatch.setattr(cpu_extension, "is_available", lambda tensor: False)
    seq_lens = [1, 16, 17, 40, 64]
    query, f32_key, f32_value, metadata = make_batch(seq_lens, seed=3)
    bf16_key, bf16_value = f32_key.bfloat16(), f32_value.bfloat16()
    new_k, new_v = torch.randn(len(seq_lens), 3, 64) * 4, torch.randn(len(seq_lens), 3, 64) * 4
    calls = spy(monkeypatch, "write_kv")
    for caches in ((f32_key, f32_value), (bf16_key, bf16_value)):
        attention.write_kv(new_k, new_v, *caches, metadata.slot_mapping)
    assert calls == (["write_kv", "write_kv"] if kernels else [])
    slots = metadata.slot_mapping
    assert torch.equal(bf16_key.view(-1, 3, 64)[slots], new_k.bfloat16())
    assert torch.equal(bf16_value.view(-1, 3, 64)[slots], new_v.bfloat16())
    exact = paged_attention(query, f32_key, f32_value, metadata, 0.125)
    rounded = paged_attention(query, bf16_key, bf16_value, metadata, 0.125)
    assert rounded.dtype == torch.float32
    torch.testing.assert_close(rounded, exact, atol=2e-2, rtol=2e-2)
    assert not torch.equal(rounded, exact)  # the rounding is there: this is not the float32 cache read twice
