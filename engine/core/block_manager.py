"""Paged KV cache accounting: fixed-size blocks, reference counts and a prefix cache.

A block is identified by the chained hash of its tokens (the parent block's
hash and its own token ids), so one hash names a whole prefix. Only full
blocks whose KV is computed are hashed. A freed hashed block stays findable
until a fresh block is needed; the free queue then hands out, first, blocks
that hold nothing, then cached ones least recently released first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.request import Request


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block, given the hash of the block before it (None for the first)."""
    h = hashlib.blake2b(parent_hash or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True)
class Block:
    """One physical KV block: how many block tables hold it and, once full and computed, its hash."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockManager:
    """Hands out KV blocks to requests and shares full blocks of common prefixes.

    Pairs: `can_allocate`/`allocate` admit a request (taking its cached
    prefix), `can_append`/`append_slots` grow it, `free` releases it, and
    `cache_full_blocks` publishes its newly computed full blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queried_tokens = 0  # prefix-cache stats outlive reset()
        self.num_hit_tokens = 0
        self.reset(num_blocks)

    def reset(self, num_blocks: int) -> None:
        """Forget every block, table and cached hash: the KV they described is gone."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Front = handed out first. Values unused: an ordered set with O(1) removal.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # per request: leading blocks already published

    # --- views ---

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evictable)."""
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of tokens, over all admissions, whose KV came from the prefix cache."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def block_table(self, req_id: str) -> list[int]:
        """The physical blocks of a request, in token order (empty if it holds none)."""
        return self.block_tables.get(req_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens of one request."""
        return -(-num_tokens // self.block_size)

    def num_cached_tokens(self, request: Request) -> int:
        """How many leading tokens of a waiting request the prefix cache already holds."""
        return len(self._cached_prefix(request)) * self.block_size

    # --- admit, grow, release ---

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether `request` can be admitted with room for `num_new_tokens` past its cached prefix."""
        hits = self._cached_prefix(request)
        num_fresh = self.num_blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        num_free_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return num_fresh <= self.num_free_blocks - num_free_hits

    def allocate(self, request: Request, num_new_tokens: int) -> list[int]:
        """Admit `request`: share its cached prefix, add fresh blocks for `num_new_tokens` more.

        Sets request.num_computed_tokens to the cached prefix length and
        returns the block table.
        """
        assert request.req_id not in self.block_tables, f"{request.req_id} already holds blocks"
        hits = self._cached_prefix(request)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        num_cached = len(hits) * self.block_size
        num_fresh = self.num_blocks_for(num_cached + num_new_tokens) - len(hits)
        table = hits + [self._take_free_block() for _ in range(num_fresh)]
        self.block_tables[request.req_id] = table
        self._num_hashed[request.req_id] = len(hits)
        request.num_computed_tokens = num_cached
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += num_cached
        return table

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        """Whether a running request can get slots for `num_new_tokens` more tokens."""
        return self._num_missing(request, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, request: Request, num_new_tokens: int) -> list[int]:
        """Grow a running request's table to hold `num_new_tokens` more; returns the new block ids."""
        new_ids = [self._take_free_block() for _ in range(self._num_missing(request, num_new_tokens))]
        self.block_tables[request.req_id].extend(new_ids)
        return new_ids

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's full blocks whose KV is now computed, for others to share."""
        if not self.enable_prefix_caching or request.req_id not in self.block_tables:
            return
        table = self.block_tables[request.req_id]
        start = self._num_hashed[request.req_id]
        end = min(request.num_computed_tokens // self.block_size, len(table))
        hashes = self._block_hashes(request)
        for i in range(start, end):
            # Two requests may compute the same block at once; the first one
            # published wins and the other's copy stays private.
            if hashes[i] not in self.hash_to_block_id:
                self.hash_to_block_id[hashes[i]] = table[i]
                self.blocks[table[i]].block_hash = hashes[i]
        self._num_hashed[request.req_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release every block of `request`; hashed ones stay cached until evicted."""
        table = self.block_tables.pop(request.req_id, [])
        self._num_hashed.pop(request.req_id, None)
        # The tail of a chain goes first into the queue, so it is evicted
        # before the prefix that other requests are likelier to share.
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed more often than taken"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.block_hash is None:
                    self.free_block_ids.move_to_end(block_id, last=False)

    # --- internals ---

    def _num_missing(self, request: Request, num_new_tokens: int) -> int:
        table = self.block_tables[request.req_id]
        return max(0, self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(table))

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.hash_to_block_id[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _block_hashes(self, request: Request) -> list[bytes]:
        hashes, size, tokens = request.block_hashes, self.block_size, request.token_ids
        while len(hashes) < len(tokens) // size:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * size:(i + 1) * size]))
        return hashes

    def _cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix, always leaving the last token to compute. None for a
        request that wants prompt logprobs: its prefill computes every position (as vLLM does)."""
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self._block_hashes(request)[:max_blocks]:
            block_id = self.hash_to_block_id.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits
