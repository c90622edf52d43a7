"""BlockPool: exact block ids, free-queue (LRU) order, ref counts and lazy eviction."""
from __future__ import annotations

from workers.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def test_new_blocks_come_from_the_head_in_id_order():
    pool = BlockPool(6)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_ids(pool) == [3, 4, 5]
    assert pool.num_free_blocks == 3


def test_too_many_blocks_answers_none_and_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    assert pool.get_new_blocks(2) is None
    assert free_ids(pool) == [3]
    assert pool.get_new_blocks(0) == []


def test_freeing_tail_first_puts_the_tail_nearest_eviction():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    assert [pool.get_new_blocks(1)[0].block_id for _ in range(4)] == [3, 4, 5, 2]


def test_shared_block_joins_the_queue_only_at_ref_zero():
    pool = BlockPool(4)
    block = pool.get_new_blocks(1)[0]
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and free_ids(pool) == [1, 2, 3]
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool) == [1, 2, 3, 0]


def test_cached_block_stays_reusable_while_free_and_touch_revives_it_from_the_middle():
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 111, 0, (1, 2, 3, 4))
    pool.free_blocks([b, a])
    assert free_ids(pool) == [2, 3, 4, 1, 0]
    assert pool.get_cached_block(111) is a
    pool.touch([a])
    assert a.ref_cnt == 1 and free_ids(pool) == [2, 3, 4, 1]
    assert pool.get_cached_block(111) is a


def test_eviction_is_lazy_when_the_block_is_popped_for_new_tokens():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 111, 0, (1, 2, 3, 4))
    pool.cache_full_block(b, 222, 111, (5, 6, 7, 8))
    pool.free_blocks([b, a])
    assert pool.get_new_blocks(1) == [b]
    assert pool.get_cached_block(222) is None and b.block_hash is None and b.token_ids is None
    assert pool.get_cached_block(111) is a


def test_a_hash_is_indexed_once_and_a_block_keeps_its_first_hash():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 111, 0, (1, 2, 3, 4))
    pool.cache_full_block(b, 111, 0, (1, 2, 3, 4))
    pool.cache_full_block(a, 999, 0, (9, 9, 9, 9))
    assert pool.get_cached_block(111) is a
    assert b.block_hash is None
    assert pool.get_cached_block(999) is None


def test_caching_disabled_indexes_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, 111, 0, (1, 2, 3, 4))
    assert pool.get_cached_block(111) is None and a.block_hash is None


def test_recent_hashes_are_newest_first_and_bounded():
    pool = BlockPool(4)
    for i, block in enumerate(pool.get_new_blocks(4)):
        pool.cache_full_block(block, 100 + i, 0, (i,))
    assert pool.recent_hashes(3) == [103, 102, 101]
    assert pool.recent_hashes(10) == [103, 102, 101, 100]


def test_free_queue_unlinks_head_middle_and_tail_in_place():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[4])
    assert queue.popleft() is blocks[0]
    assert [b.block_id for b in queue] == [1, 3] and len(queue) == 2
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 0]


def test_reset_prefix_cache_forgets_idle_cached_blocks_and_keeps_held_ones():
    pool = BlockPool(4)
    held, idle = pool.get_new_blocks(2)
    pool.cache_full_block(held, 1, 0, (1,))
    pool.cache_full_block(idle, 2, 1, (2,))
    pool.free_blocks([idle])
    assert pool.reset_prefix_cache() == 1
    assert pool.get_cached_block(2) is None and idle.block_hash is None
    assert pool.get_cached_block(1) is held                  # a request still holds it
    assert free_ids(pool) == [2, 3, 1] and pool.recent_hashes(8) == [1]
