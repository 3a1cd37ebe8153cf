"""paged_attention against dense causal attention, over random batches."""

from __future__ import annotations

import random

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.model.attention import AttentionMetadata, paged_attention, write_kv

NUM_BLOCKS = 4 * 29  # enough for 4 sequences of up to 29 tokens in blocks of 1


def dense_attention(q, k, v, scale):
    """q [n, H, D] as the last n of k, v [L, H_kv, D]: the plain causal reference."""
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    visible = torch.arange(seq_len) <= torch.arange(n).unsqueeze(1) + (seq_len - n)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
# two whole prompts of one length (one batched call), a chunk of that length after cached tokens (not
# one of them), a one-token prompt (a decode)
@example(seqs=[(0, 5), (3, 5), (0, 5), (0, 1)], block_size=4, group=3, seed=7)
def test_paged_attention_equals_dense_causal_attention(seqs, block_size, group, seed):
    """seqs: (cached tokens, new tokens) each; single new tokens are decodes, whole prompts of one
    length go in one call."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = 2, 8
    num_heads = num_kv_heads * group
    key_cache = torch.zeros(NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    full_k = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in seqs]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in seqs]
    num_cached = [c for c, _ in seqs]
    old = lambda xs: torch.cat([x[:c] for x, c in zip(xs, num_cached)])  # noqa: E731
    new = lambda xs: torch.cat([x[c:] for x, c in zip(xs, num_cached)])  # noqa: E731
    # the cached part, as earlier steps would have written it
    cached = AttentionMetadata.build([0] * len(seqs), num_cached, tables, block_size)
    write_kv(old(full_k), old(full_v), key_cache, value_cache, cached.slot_mapping)

    metadata = AttentionMetadata.build(num_cached, [n for _, n in seqs], tables, block_size)
    write_kv(new(full_k), new(full_v), key_cache, value_cache, metadata.slot_mapping)
    query = torch.randn(sum(n for _, n in seqs), num_heads, head_dim, generator=gen)
    starts = metadata.query_start_loc.tolist()
    # from the cache alone, and with this step's K/V at hand (whole prompts then read those)
    for step_kv in ({}, {"key": new(full_k), "value": new(full_v)}):
        out = paged_attention(query, key_cache, value_cache, metadata, head_dim ** -0.5, **step_kv)
        for i in range(len(seqs)):
            q = query[starts[i]:starts[i + 1]]
            expected = dense_attention(q, full_k[i], full_v[i], head_dim ** -0.5)
            torch.testing.assert_close(out[starts[i]:starts[i + 1]], expected, atol=1e-5, rtol=1e-5)


def test_metadata_build_maps_tokens_to_slots():
    metadata = AttentionMetadata.build([5, 0], [1, 3], [[7, 2], [4]], block_size=4)
    assert metadata.slot_mapping.tolist() == [2 * 4 + 1, 16, 17, 18]
    assert metadata.query_start_loc.tolist() == [0, 1, 4]
    assert metadata.seq_lens.tolist() == [6, 3]
    assert metadata.block_tables.tolist() == [[7, 2], [4, 0]]
    assert metadata.block_tables.dtype == torch.int32
    assert (metadata.max_seq_len, metadata.is_decode_only) == (6, False)


def test_decode_batch_agrees_with_the_kernels_torch_reference():
    """paged_attention's decode path and engine/ops' reference (which the
    Triton kernel is tested against) compute the same thing on the same cache."""
    from engine.ops.triton_paged_attention import paged_attention_decode_reference

    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = torch.randn(2, 20, 16, 3, 32, generator=gen)
    tables = torch.randperm(20, generator=gen)[:12].view(3, 4).tolist()
    metadata = AttentionMetadata.build([9, 40, 63], [1, 1, 1], tables, block_size=16)
    query = torch.randn(3, 9, 32, generator=gen)
    expected = paged_attention_decode_reference(query, key_cache, value_cache, metadata.block_tables,
                                                metadata.seq_lens, 32 ** -0.5)
    out = paged_attention(query, key_cache, value_cache, metadata, 32 ** -0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
