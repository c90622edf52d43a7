"""Maps requests to KV blocks: prefix-cache lookups, slot allocation, caching full blocks, freeing."""
from __future__ import annotations

from collections.abc import Sequence

from llmmesh.prefix_hash import root_hash

from workers.engine.block_pool import BlockPool, KVBlock
from workers.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        # How many leading blocks of each request are already indexed, so caching stays O(new).
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, verified block by block against stored tokens."""
        if not self.enable_caching:
            return [], 0
        size = self.block_size
        # The last token is always recomputed: the step needs its hidden state for logits.
        max_hits = min((request.num_tokens - 1) // size, len(request.block_hashes))
        tokens = request.all_token_ids
        parent = root_hash(request.cache_salt)
        hits: list[KVBlock] = []
        for i in range(max_hits):
            block = self.pool.get_cached_block(request.block_hashes[i])
            # A hash collision must never hand one tenant another's KV: check the content too.
            if (block is None or block.parent_hash != parent
                    or block.token_ids != tuple(tokens[i * size:(i + 1) * size])):
                break
            hits.append(block)
            parent = block.block_hash
        return hits, len(hits) * size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = ()) -> list[KVBlock] | None:
        """Blocks for `num_new_tokens` more tokens (after any prefix hits), or None if they do not
        fit; then nothing changes and the caller decides whom to preempt."""
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new = max(0, num_required - len(request.block_ids) - len(new_computed_blocks))
        # Hits that sit in the free queue stop being free once touched.
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed_blocks)
        request.block_ids.extend(block.block_id for block in new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new)
        request.block_ids.extend(block.block_id for block in new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request) -> None:
        """Index the request's blocks that are full and whose KV has been computed."""
        if not self.enable_caching:
            return
        size, hashes = self.block_size, request.block_hashes
        num_full = min(request.num_computed_tokens // size, len(hashes), len(request.block_ids))
        start = self._num_cached_blocks.get(request.request_id, 0)
        tokens = request.all_token_ids
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else root_hash(request.cache_salt)
            self.pool.cache_full_block(self.pool.blocks[request.block_ids[i]], hashes[i], parent,
                                       tuple(tokens[i * size:(i + 1) * size]))
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        blocks = self.pool.blocks
        self.pool.free_blocks(blocks[i] for i in reversed(request.block_ids))
        request.block_ids = []
        self._num_cached_blocks.pop(request.request_id, None)
