"""Block accounting, prefix sharing by chained hashes, and least-recently-used eviction."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager, hash_block
from engine.core.request import Request

BS = 4


def computed(bm, request, num_tokens):
    """Pretend a worker computed `num_tokens` more tokens of `request`, then publish full blocks."""
    request.num_computed_tokens += num_tokens
    bm.cache_full_blocks(request)


def admit(bm, request):
    """Admit and compute a whole request's tokens, as one prefill."""
    num_new = request.num_tokens - bm.num_cached_tokens(request)
    assert bm.can_allocate(request, num_new)
    bm.allocate(request, num_new)
    computed(bm, request, num_new)
    return bm.block_table(request.req_id)


def test_allocate_append_free_counts_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    r = Request("a", list(range(5)))
    assert bm.can_allocate(r, 5) and not bm.can_allocate(r, 17)
    assert len(bm.allocate(r, 5)) == 2 and bm.num_free_blocks == 2 and bm.usage == 0.5
    computed(bm, r, 5)
    r.append_token(9)
    assert bm.can_append(r, 1)
    assert bm.append_slots(r, 1) == []  # token 6 still fits in block 2
    computed(bm, r, 1)
    assert bm.can_append(r, 10) and not bm.can_append(r, 11)
    assert len(bm.append_slots(r, 3)) == 1
    bm.free(r)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0 and bm.block_table("a") == []


def test_same_three_block_prefix_shares_physical_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prefix = list(range(100, 112))  # three full blocks
    a = Request("a", prefix + [1, 2])
    table_a = admit(bm, a)
    b = Request("b", prefix + [7, 8, 9])
    assert bm.num_cached_tokens(b) == 12
    table_b = bm.allocate(b, 3)
    assert b.num_computed_tokens == 12
    assert table_b[:3] == table_a[:3] and table_b[3] not in table_a
    assert all(bm.blocks[i].ref_count == 2 for i in table_a[:3])
    assert bm.num_hit_tokens == 12 and bm.prefix_cache_hit_rate == pytest.approx(12 / (14 + 15))
    bm.free(a)
    assert all(bm.blocks[i].ref_count == 1 for i in table_a[:3])
    assert bm.blocks[table_a[3]].ref_count == 0  # a's private partial block


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))  # exactly two full blocks
    admit(bm, Request("a", tokens))
    b = Request("b", tokens)
    assert bm.num_cached_tokens(b) == 4  # the second block is recomputed for b's logits
    bm.allocate(b, 4)
    assert b.num_computed_tokens == 4


def test_hash_covers_the_whole_prefix():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0, 0]), [1, 2])
    bm = BlockManager(num_blocks=8, block_size=BS)
    admit(bm, Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # same second block, different first block: no hit at all
    assert bm.num_cached_tokens(Request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0


def test_partial_and_uncomputed_blocks_are_not_cached():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Request("a", list(range(10)))
    bm.allocate(a, 10)
    computed(bm, a, 6)  # a prefill chunk: only block 0 is full and computed
    assert len(bm.hash_to_block_id) == 1
    assert bm.num_cached_tokens(Request("b", list(range(10)))) == 4


def take_fresh(bm, req_id, num_blocks):
    """Allocate `num_blocks` blocks for a prompt that hits nothing; they come in eviction order."""
    filler = Request(req_id, [-1] * (num_blocks * BS))
    return bm.allocate(filler, num_blocks * BS)


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = Request("a", [1] * 8 + [0]), Request("b", [2] * 8 + [0])
    table_a, table_b = admit(bm, a), admit(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 6
    # blocks that hold nothing go first, then a's chain tail before its head, then b's
    assert take_fresh(bm, "f1", 4) == [table_b[2], table_a[2], table_a[1], table_a[0]]
    assert bm.num_cached_tokens(Request("a2", [1] * 9)) == 0  # a's chain is gone
    assert bm.num_cached_tokens(Request("b2", [2] * 9)) == 8  # b's is whole
    assert take_fresh(bm, "f2", 1) == [table_b[1]]
    assert bm.num_cached_tokens(Request("b3", [2] * 9)) == 4  # only b's head is left


def test_a_cache_hit_refreshes_recency():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a, b = Request("a", [1] * 4 + [0]), Request("b", [2] * 4 + [0])
    block_a, block_b = admit(bm, a)[0], admit(bm, b)[0]
    bm.free(a)
    bm.free(b)
    again = Request("a-again", [1] * 4 + [5])
    assert admit(bm, again)[0] == block_a  # a's block is used again...
    bm.free(again)                         # ...so b's is now the older one
    assert take_fresh(bm, "f", 3)[2] == block_b


def test_can_allocate_counts_free_cached_hits_as_taken():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = Request("a", list(range(9)))
    admit(bm, a)
    bm.free(a)
    b = Request("b", list(range(9)) + [42] * 4)
    # 2 cached blocks, both free, plus 2 fresh ones for 5 new tokens: 4 > 3
    assert bm.num_cached_tokens(b) == 8
    assert not bm.can_allocate(b, 5)
    assert bm.can_allocate(b, 4)
    bm.allocate(b, 4)
    assert bm.num_free_blocks == 0


def test_reset_drops_everything_but_keeps_stats():
    bm = BlockManager(num_blocks=4, block_size=BS)
    admit(bm, Request("a", list(range(9))))
    bm.reset(7)
    assert bm.num_free_blocks == 7 and bm.hash_to_block_id == {} and bm.block_tables == {}
    assert bm.num_cached_tokens(Request("b", list(range(9)))) == 0
    assert bm.num_queried_tokens == 9


def test_without_prefix_caching_nothing_is_shared():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    admit(bm, Request("a", list(range(9))))
    assert bm.hash_to_block_id == {} and bm.num_cached_tokens(Request("b", list(range(9)))) == 0


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (4, 0)])
def test_bad_sizes_are_refused(num_blocks, block_size):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(num_blocks, block_size)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 13)), min_size=1, max_size=12))
def test_any_admission_order_frees_back_to_a_full_pool(specs):
    """Requests built from three shared prefixes: refcounts always match the tables."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    live = []
    for n, (prefix, length) in enumerate(specs):
        live.append(Request(str(n), [prefix] * 6 + list(range(length))))
        admit(bm, live[-1])
        if n % 3 == 2:
            bm.free(live.pop(0))
        held = [b for r in live for b in bm.block_table(r.req_id)]
        assert all(bm.blocks[i].ref_count == held.count(i) for i in range(64))
        assert set(bm.free_block_ids) == {i for i in range(64) if i not in held}
    for r in live:
        bm.free(r)
    assert bm.num_free_blocks == 64
