"""Paged-KV block accounting with prefix caching. Pure Python: integer ids, ref counts, free queues.

A block is ``block_size`` token slots. Every block is in exactly one of three states:

- in use: ``ref_count > 0`` (held by one or more requests);
- cached-free: ``ref_count == 0`` but it holds a full block whose chained hash is registered, so a
  later request with the same prefix can take it back; evicted least-recently-used;
- free: ``ref_count == 0`` and holds nothing worth keeping.

The chained hash of block ``i`` is ``sha256(hash(block i-1) || token ids of block i)``. It is stable
across processes (unlike Python's salted ``hash``), so prefill and decode workers agree on it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import NamedTuple

from pdserve.engine.request import Request

_ROOT_HASH = b"pdserve-kv-root"


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """Chained, process-stable hash of one full block of tokens."""
    h = hashlib.sha256(parent_hash or _ROOT_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def compute_block_hashes(
    token_ids: list[int], block_size: int, start: list[bytes] | None = None, num_blocks: int | None = None
) -> list[bytes]:
    """Hashes of every full block of ``token_ids`` (of its first ``num_blocks`` when given), extending the
    already known ``start`` list."""
    hashes = list(start or [])
    for i in range(len(hashes), len(token_ids) // block_size if num_blocks is None else num_blocks):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


class BlockUsage(NamedTuple):
    total: int
    free: int  # neither in use nor cached
    cached: int  # not in use, but holding a reusable prefix block
    used: int


class PrefixHit(NamedTuple):
    block_ids: list[int]
    num_tokens: int


class BlockManager:
    """Allocates KV blocks to requests; finds and shares cached prefix blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self.hash_to_block: dict[bytes, int] = {}
        self.on_reuse: Callable[[int], None] | None = None  # called with a free block's id as it is handed out

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_available_blocks(self) -> int:
        """Blocks that an allocation can take now (free, or cached-free and evictable)."""
        return len(self.free_blocks) + len(self.cached_free)

    def usage(self) -> BlockUsage:
        free, cached = len(self.free_blocks), len(self.cached_free)
        return BlockUsage(self.num_blocks, free, cached, self.num_blocks - free - cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """Longest run of cached full blocks at the start of the request's tokens.

        Never covers the last known token: the step that computes it must produce logits. None for a request
        whose prompt log-probabilities are still to compute (every prompt position needs its logits).
        """
        if not self.enable_prefix_caching or request.needs_prompt_logits:
            return PrefixHit([], 0)
        request.block_hashes = compute_block_hashes(request.all_token_ids, self.block_size, request.block_hashes)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return PrefixHit(hit, len(hit) * self.block_size)

    # ---- allocation ----------------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        hit_blocks = hit.block_ids if hit else []
        reused_free = sum(1 for b in hit_blocks if self.ref_counts[b] == 0)
        have = len(request.block_ids) + len(hit_blocks)
        computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        need = max(0, self.blocks_needed(computed + num_new_tokens) - have)
        return need <= self.num_available_blocks - reused_free

    def take_prefix_hit(self, request: Request, hit: PrefixHit) -> None:
        """Share the hit blocks with the request and mark their tokens computed."""
        assert not request.block_ids and request.num_computed_tokens == 0, request
        for block_id in hit.block_ids:
            if self.ref_counts[block_id] == 0:
                del self.cached_free[block_id]
            self.ref_counts[block_id] += 1
        request.block_ids = list(hit.block_ids)
        request.num_registered_blocks = 0
        request.num_computed_tokens = hit.num_tokens
        request.num_cached_tokens = hit.num_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make the request's blocks cover ``num_computed_tokens + num_new_tokens`` slots.

        Returns False, and changes nothing, when there are not enough blocks.
        """
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if need > self.num_available_blocks:
            return False
        for _ in range(need):
            request.block_ids.append(self._pop_free_block())
        return True

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks. Blocks with a registered hash stay cached."""
        # Tail blocks first, so the most specific suffixes are evicted before shared prefixes.
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                if self.block_hash[block_id] is not None:
                    self.cached_free[block_id] = None
                else:
                    self.free_blocks.append(block_id)
        request.block_ids = []
        request.num_registered_blocks = 0

    def cache_full_blocks(self, request: Request) -> None:
        """Register the hashes of the request's blocks that are now full and computed.

        The leading blocks found registered stay so while the request holds them (only a free block is
        evicted), so each call starts after them (``request.num_registered_blocks``): a decode's call
        costs its new blocks, not its whole context."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        known = request.block_hashes
        if len(known) > num_full:
            request.block_hashes = known[:num_full]
        elif len(known) < num_full:
            request.block_hashes = compute_block_hashes(request.all_token_ids, self.block_size, known, num_full)
        leading = min(request.num_registered_blocks, num_full)
        for i in range(leading, num_full):
            block_id, block_hash = request.block_ids[i], request.block_hashes[i]
            if self.block_hash[block_id] is None and block_hash not in self.hash_to_block:
                self.block_hash[block_id] = block_hash
                self.hash_to_block[block_hash] = block_id
            if self.block_hash[block_id] is not None and leading == i:
                leading = i + 1  # registered (by this request or the one it shares the block with)
        request.num_registered_blocks = leading

    def _pop_free_block(self) -> int:
        if self.free_blocks:
            block_id = self.free_blocks.popleft()
        else:
            block_id, _ = self.cached_free.popitem(last=False)  # evict the least recently used
            evicted = self.block_hash[block_id]
            assert evicted is not None  # a block in cached_free always has a hash
            del self.hash_to_block[evicted]
            self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        if self.on_reuse is not None:
            self.on_reuse(block_id)
        return block_id

    # ---- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless free + cached-free + in-use == total and the maps agree."""
        free, cached = set(self.free_blocks), set(self.cached_free)
        used = {b for b, rc in enumerate(self.ref_counts) if rc > 0}
        assert len(free) == len(self.free_blocks), "duplicate block in free queue"
        assert not (free & cached) and not (free & used) and not (cached & used), "block in two states"
        assert len(free) + len(cached) + len(used) == self.num_blocks, (
            f"leak: free {len(free)} + cached {len(cached)} + used {len(used)} != total {self.num_blocks}"
        )
        assert all(rc >= 0 for rc in self.ref_counts), "negative ref count"
        for block_hash, block_id in self.hash_to_block.items():
            assert self.block_hash[block_id] == block_hash, f"hash map disagrees for block {block_id}"
        for block_id in cached:
            assert self.block_hash[block_id] is not None, f"cached-free block {block_id} has no hash"
