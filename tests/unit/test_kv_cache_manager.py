"""KVCacheManager with block_size 4: prefix hits, salts, token verification, slots, freeing order."""
from __future__ import annotations

from llmmesh.prefix_hash import block_hashes
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.request import Request
from workers.engine.sampling import SamplingParams

BLOCK = 4


def make_request(request_id: str, tokens: list[int], salt: str = "") -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=8), block_size=BLOCK,
                   cache_salt=salt)


def prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """Admit and compute the whole prompt as the scheduler would; returns its block ids."""
    hits, num_cached = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_cached, hits) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    return request.block_ids


def free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.pool.free_queue]


def test_request_hashes_match_the_shared_prefix_hash():
    request = make_request("a", list(range(11)), salt="t1")
    assert request.block_hashes == block_hashes(list(range(11)), BLOCK, "t1")
    request.append_output_token_id(11)
    assert request.block_hashes == block_hashes(list(range(12)), BLOCK, "t1")


def test_prefill_takes_exact_blocks_and_caches_only_full_ones():
    manager = KVCacheManager(10, BLOCK)
    a = make_request("a", list(range(11)))            # 2 full blocks + 3 tokens
    assert manager.get_computed_blocks(a) == ([], 0)
    assert prefill(manager, a) == [0, 1, 2]
    blocks = manager.pool.blocks
    assert [blocks[i].block_hash for i in (0, 1)] == a.block_hashes
    assert blocks[2].block_hash is None
    assert blocks[1].token_ids == (4, 5, 6, 7)


def test_same_salt_hits_the_shared_prefix_and_shares_blocks():
    manager = KVCacheManager(10, BLOCK)
    a = make_request("a", list(range(11)), salt="t1")
    prefill(manager, a)
    b = make_request("b", list(range(8)) + [50, 51, 52], salt="t1")
    hits, num_cached = manager.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8
    assert [blk.block_id for blk in manager.allocate_slots(b, 3, hits)] == [3]
    assert b.block_ids == [0, 1, 3]
    assert [manager.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]


def test_other_salt_gets_zero_cached_tokens():
    manager = KVCacheManager(10, BLOCK)
    prefill(manager, make_request("a", list(range(11)), salt="tenant-1"))
    other = make_request("b", list(range(11)), salt="tenant-2")
    assert manager.get_computed_blocks(other) == ([], 0)


def test_hits_are_verified_against_stored_tokens_and_parent():
    manager = KVCacheManager(10, BLOCK)
    prefill(manager, make_request("a", list(range(11))))
    blocks = manager.pool.blocks
    blocks[1].token_ids = (4, 5, 6, 99)          # as if hash 1 collided with other content
    hits, num_cached = manager.get_computed_blocks(make_request("b", list(range(11))))
    assert [h.block_id for h in hits] == [0] and num_cached == 4
    blocks[0].parent_hash ^= 1                   # block 0 from another chain (salt)
    assert manager.get_computed_blocks(make_request("c", list(range(11)))) == ([], 0)


def test_last_prompt_token_is_always_recomputed():
    manager = KVCacheManager(10, BLOCK)
    prefill(manager, make_request("a", list(range(8))))      # exactly two full blocks
    hits, num_cached = manager.get_computed_blocks(make_request("b", list(range(8))))
    assert [h.block_id for h in hits] == [0] and num_cached == 4
    hits, num_cached = manager.get_computed_blocks(make_request("c", list(range(9))))
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8


def test_free_returns_tail_first_so_shared_heads_are_evicted_last():
    manager = KVCacheManager(10, BLOCK)
    a = make_request("a", list(range(11)))
    prefill(manager, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    prefill(manager, b)                                       # blocks [0, 1, 3]
    manager.free(a)
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 2]         # 0 and 1 still held by b
    manager.free(b)
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert a.block_ids == [] and manager.num_free_blocks == 10


def test_new_allocations_evict_lru_and_the_surviving_prefix_still_hits():
    manager = KVCacheManager(4, BLOCK)
    a = make_request("a", list(range(12)))                    # blocks 0,1,2 all cached
    prefill(manager, a)
    manager.free(a)                                           # queue [3, 2, 1, 0]
    prefill(manager, make_request("x", [90, 91, 92, 93, 94, 95, 96]))   # takes 3 then 2
    assert manager.pool.blocks[2].block_hash is None
    hits, num_cached = manager.get_computed_blocks(make_request("c", list(range(13))))
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing():
    manager = KVCacheManager(3, BLOCK)
    a = make_request("a", list(range(9)))
    assert manager.allocate_slots(a, 13) is None
    assert a.block_ids == [] and manager.num_free_blocks == 3
    assert [blk.block_id for blk in manager.allocate_slots(a, 9)] == [0, 1, 2]


def test_revived_hits_count_against_free_blocks():
    manager = KVCacheManager(3, BLOCK)
    a = make_request("a", list(range(9)))
    prefill(manager, a)
    manager.free(a)                                           # all 3 free, 0 and 1 cached
    b = make_request("b", list(range(8)) + [7, 7, 7, 7, 7])   # 13 tokens: needs 4 blocks
    hits, num_cached = manager.get_computed_blocks(b)
    assert num_cached == 8
    assert manager.allocate_slots(b, 5, hits) is None
    assert [h.ref_cnt for h in hits] == [0, 0] and manager.num_free_blocks == 3


def test_decode_fills_the_last_block_and_caches_it_once_full():
    manager = KVCacheManager(10, BLOCK)
    a = make_request("a", list(range(7)))
    prefill(manager, a)                                       # blocks [0, 1], 1 has 3 tokens
    a.append_output_token_id(100)
    assert manager.allocate_slots(a, 1) == []                 # fits in block 1
    a.num_computed_tokens += 1
    manager.cache_blocks(a)
    assert manager.pool.blocks[1].block_hash == a.block_hashes[1]
    a.append_output_token_id(101)
    assert [blk.block_id for blk in manager.allocate_slots(a, 1)] == [2]


def test_caching_disabled_never_hits():
    manager = KVCacheManager(10, BLOCK, enable_caching=False)
    prefill(manager, make_request("a", list(range(11))))
    assert manager.get_computed_blocks(make_request("b", list(range(11)))) == ([], 0)
    assert manager.pool.cached == {}
