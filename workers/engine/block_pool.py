"""The fixed pool of KV blocks: ref counts, the LRU free queue and the prefix-hash index."""
from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids",
                 "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set once the block is full and its KV computed; kept while the block sits free, so a
        # later request can revive it, and dropped only when the block is reused for new tokens.
        self.block_hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks, least recently freed at the head. A cached block that
    gets a hit is unlinked from the middle in O(1), which a deque cannot do."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)     # sentinels keep every unlink branch-free
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        block.prev_free, block.next_free = last, self._tail
        last.next_free = self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> KVBlock:
        if not self._len:
            raise IndexError("no free blocks")
        block = self._head.next_free
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self.free_queue = FreeBlockQueue(self.blocks)
        # Insertion-ordered, so the newest cached hashes are the dict's tail (see recent_hashes).
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evicted on demand)."""
        return len(self.free_queue)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock] | None:
        if num_blocks > len(self.free_queue):
            return None
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving those that sat in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the queue in the given order, so
        callers pass a sequence's tail first to have it evicted before its shared head."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: KVBlock, block_hash: int, parent_hash: int,
                         token_ids: tuple[int, ...]) -> None:
        # Another block may already hold this hash (two requests prefilled the same prefix at
        # once); the index keeps the first and this copy simply stays unindexed.
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (they stay free); returns how many."""
        idle = [block for block in self.cached.values() if block.ref_cnt == 0]
        for block in idle:
            self._evict(block)
        return len(idle)

    def recent_hashes(self, limit: int) -> list[int]:
        hashes = []
        for block_hash in reversed(self.cached):
            if len(hashes) == limit:
                break
            hashes.append(block_hash)
        return hashes

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = block.parent_hash = block.token_ids = None
