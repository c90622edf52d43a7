"""Chained prefix-block hashes shared by gateway, router and workers.

Block i's hash covers the salt and every token of blocks 0..i, so two requests share a
hash only when they share the whole prefix up to that block *and* the cache scope.
Only full blocks are hashed: a partial block can still change and is never reused.
"""
from __future__ import annotations

from collections.abc import Sequence
from array import array

import xxhash

# The root of each chain mixes in the salt, so tenants in different cache scopes never
# collide even on identical prompts (the salt comes from the gateway, never the client).


def root_hash(salt: str) -> int:
    return xxhash.xxh3_64_intdigest(b"llmmesh-prefix-v1:" + salt.encode())


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    data = parent_hash.to_bytes(8, "little") + array("i", token_ids).tobytes()
    return xxhash.xxh3_64_intdigest(data)


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str) -> list[int]:
    """Hashes of every full block of `token_ids`, chained from the salt's root."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    hashes: list[int] = []
    parent = root_hash(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def cache_salt(cache_scope: str, model: str) -> str:
    """The salt of a tenant's requests for one model: prefixes are shared inside a cache scope
    and a model, never across (a worker hosting two models publishes one index for both)."""
    return f"scope:{cache_scope}|model:{model}"
