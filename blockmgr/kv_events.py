"""KV cache events in vLLM 0.32's format (vllm/distributed/kv_events.py), so a
consumer written for vLLM (llm-d's KV-cache indexer, a prefix-aware router)
reads ours unchanged.

The prefix cache is the pools' (``BlockPool.cached``); this log only hears
its changes: ``stored`` when a block's key is registered, ``removed`` when it
is evicted, ``cleared`` when the manager is (re)created. The key's parent and
token ids come from ``keyed``, called where the manager computes a key. One
step's events make one ``KVEventBatch``, as one vLLM engine step does.

Block hashes are our prefix-cache keys (``prefix_cache.hash_block``: sha256
chained from the empty key, or the cache salt's), so the same tokens give the
same hash on every replica with no shared seed. They are published as vLLM
does by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the digest's low
64 bits as an int."""
from __future__ import annotations

import time

import msgspec

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


def external_hash(key: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash`` with int hashes on (its default)."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


class KVEventLog:
    """The events of the current step, and what each live key was made of."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []
        # key -> (parent key, token ids): for every key pending or cached somewhere
        self._made_of: dict[bytes, tuple[bytes, list[int]]] = {}
        self._cached_in: dict[bytes, set[str]] = {}  # key -> the media whose pool caches it

    def keyed(self, key: bytes, parent: bytes, token_ids: list[int]) -> None:
        self._made_of[key] = (parent, list(token_ids))

    def stored(self, key: bytes, medium: str) -> None:
        parent, tokens = self._made_of[key]
        self._cached_in.setdefault(key, set()).add(medium)
        # The chain's root (the empty key, or a salt's) is no block: vLLM's parent is None there.
        has_parent = parent in self._made_of
        self._events.append(BlockStored([external_hash(key)], external_hash(parent) if has_parent else None,
                                        tokens, self.block_size, None, medium, None))

    def removed(self, key: bytes, medium: str) -> None:
        where = self._cached_in.get(key)
        if where is not None:
            where.discard(medium)
            if not where:
                del self._cached_in[key]
        self._events.append(BlockRemoved([external_hash(key)], medium))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())
        self._made_of.clear()
        self._cached_in.clear()

    def forget_uncached(self, pending: set[bytes]) -> None:
        """Drop what keys no pool caches and no block awaits were made of
        (a step rolled back, a sequence freed before its block was written).
        A parent stays while a cached child may still name it."""
        keep = set(self._cached_in) | pending
        keep |= {self._made_of[k][0] for k in keep if k in self._made_of}
        for k in [k for k in self._made_of if k not in keep]:
            del self._made_of[k]

    def take_batch(self) -> KVEventBatch | None:
        """The step's events as one batch (None when there were none)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(time.time(), events, 0)  # type: ignore[arg-type]
