"""Prefix-cache keys: a full block is keyed by sha256(parent key + its token
ids); the chain's root is the empty key, or sha256 of the request's cache salt.

Only the keys live here; which block holds which key is the pool's
(``BlockPool.cached``), and when a key is committed is the manager's."""
from __future__ import annotations

import hashlib
from array import array

from pagedserve.blockmgr.block_pool import Block


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Key of a full block: chained over the parent block's key."""
    try:
        data = b"q" + array("q", token_ids).tobytes()
    except OverflowError:  # ids beyond int64 still hash, they just take the slow path
        data = b"r" + repr(token_ids).encode()
    return hashlib.sha256(parent + data).digest()


def root_key(cache_salt: str | None) -> bytes:
    if cache_salt is None:
        return b""
    return hashlib.sha256(b"salt\x00" + cache_salt.encode()).digest()


def lookup_prefix(cached: dict[bytes, Block], token_ids: list[int], root: bytes,
                  block_size: int) -> tuple[list[Block], bytes, int]:
    """Cached full blocks of the prompt, never the whole prompt (its last token
    is always computed); returns them, the key of the last hit and how many
    blocks were looked up."""
    max_hits = (len(token_ids) - 1) // block_size
    hits: list[Block] = []
    key = root
    for i in range(max_hits):
        k = hash_block(key, token_ids[i * block_size:(i + 1) * block_size])
        b = cached.get(k)
        if b is None:
            break
        hits.append(b)
        key = k
    return hits, key, max_hits
