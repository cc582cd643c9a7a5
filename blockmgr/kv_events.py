"""KV cache events in vLLM 0.32's format (vllm/distributed/kv_events.py), so a
consumer written for vLLM (llm-d's KV-cache indexer, a prefix-aware router)
reads ours unchanged.

The prefix cache is the pools' (``BlockPool.cached``); this log only hears
its changes: ``stored`` when a block's key is registered, ``removed`` when it
is evicted, ``cleared`` when the manager is (re)created. The key's parent and
token ids come from ``keyed``, called where the manager computes a key. One
step's events make one ``KVEventBatch``, as one vLLM engine step does.

Published block hashes are vLLM's ``sha256_cbor`` ones (the reproducible,
cross-language algorithm llm-d deploys vLLM with:
``--prefix-caching-hash-algo sha256_cbor`` and a shared ``PYTHONHASHSEED``):
sha256 of the canonical CBOR of ``(parent hash, token ids, None)``, chained
from ``sha256_cbor(seed)``, the seed being $PYTHONHASHSEED or vLLM's default
"vllm-none-hash". The same tokens give the same hash on every replica, ours
or vLLM's, and llm-d's indexer, which computes a prompt's hashes the same
way, finds them. Sent as vLLM's default int form (low 64 bits). A chain
under a cache salt hashes from the salt's root instead, so it never meets
an unsalted one (vLLM puts the salt in the first block's extra keys: salted
hashes are ours alone)."""
from __future__ import annotations

import time

import msgspec

from pagedserve.common.block_hash import NONE_HASH, external_hash, sha256_cbor_block

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[object]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """vLLM's base: events are tagged by class name ({"type": "BlockStored", ...})."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


class KVEventLog:
    """The events of the current step, and what each live key was made of."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []
        # key -> (parent key, token ids, vLLM's hash): for every key pending or cached somewhere
        self._made_of: dict[bytes, tuple[bytes, list[int], bytes]] = {}
        self._cached_in: dict[bytes, set[str]] = {}  # key -> the media whose pool caches it

    def keyed(self, key: bytes, parent: bytes, token_ids: list[int]) -> None:
        up = self._made_of.get(parent)
        # The chain's root is no block: the empty key (vLLM's NONE_HASH), or a salt's root key.
        root = NONE_HASH if parent == b"" else parent
        self._made_of[key] = (parent, list(token_ids), sha256_cbor_block(up[2] if up else root, token_ids))

    def stored(self, key: bytes, medium: str) -> None:
        made = self._made_of.get(key)
        if made is None:  # a key never ``keyed``: a hybrid model's non-first KV cache group
            return
        parent, tokens, vllm_hash = made
        self._cached_in.setdefault(key, set()).add(medium)
        up = self._made_of.get(parent)  # vLLM's parent is None for a chain's first block
        self._events.append(BlockStored([external_hash(vllm_hash)], external_hash(up[2]) if up else None,
                                        tokens, self.block_size, None, medium, None))

    def removed(self, key: bytes, medium: str) -> None:
        if key not in self._made_of:  # never keyed (see ``stored``)
            return
        where = self._cached_in.get(key)
        if where is not None:
            where.discard(medium)
            if not where:
                del self._cached_in[key]
        self._events.append(BlockRemoved([external_hash(self._made_of[key][2])], medium))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())
        self._made_of.clear()
        self._cached_in.clear()

    def forget_uncached(self) -> None:
        """Drop what keys no pool caches were made of (a step rolled back, a
        sequence freed before its block was written); call it between steps,
        when no key is pending. A parent stays while a cached child may still
        name it. A scan of every live key, so only once the stale ones could
        be as many as the cached ones (not on every step)."""
        if len(self._made_of) <= 2 * len(self._cached_in) + 1024:
            return
        keep = set(self._cached_in)
        keep |= {self._made_of[k][0] for k in keep if k in self._made_of}
        for k in [k for k in self._made_of if k not in keep]:
            del self._made_of[k]

    def take_batch(self) -> KVEventBatch | None:
        """The step's events as one batch (None when there were none)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(time.time(), events, 0)  # type: ignore[arg-type]
