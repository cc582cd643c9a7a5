"""The hybrid KV cache (docs/blockmgr.md, "Sliding-window layers"): a model's
layers form KV cache groups of equal layer count, each full-attention or
sliding with window W, sharing one block pool (a block id names the same
storage index in each group's layers; the worker keeps one tensor pair per
layer position of a group). Every request's sequence has one table per
group, kept here as an ordinary ``SeqTable`` under the internal id
``seq_id * G + g``, so prefix caching, copy-on-write, fork, swap and the
step's holds are the base manager's, per group.

What the groups add:

* **Release.** Before an ``Append``, a sliding group replaces every block
  wholly before ``p - W + 1`` (``p`` the position of the first token the
  append computes: a chunk's first query needs the window before it) by
  ``NULL_ENTRY`` (block 0 on the wire) and drops its reference; a full group
  keeps everything. Released blocks keep their prefix key (free and cached).
  The worker is not told (its stale ids lie outside the window, so the
  sliding layers' mask never lets them count); a swap-in or fork sends the
  nulls.
* **Admission is all or nothing across groups**: an ``Allocate`` or
  ``Append`` checks the room all groups need before any group takes a block.
* **Prefix caching** keys each group's blocks on its own chain (group 0 from
  the request's root, group g > 0 from a root salted with g, so keys of
  different groups never meet). A hit of n blocks needs blocks 0..n-1 cached
  in every full group and, in every sliding group, the blocks from
  ``(n * block_size - W + 1) // block_size`` to n - 1; every group takes the
  same n. Counters and KV events follow group 0 only (events stay vLLM's).
"""
from __future__ import annotations

import hashlib

from pagedserve.blockmgr.block_pool import Block
from pagedserve.blockmgr.manager import BlockManager
from pagedserve.blockmgr.prefix_cache import hash_block, root_key
from pagedserve.blockmgr.seq_table import NULL_ENTRY, BlockManagerError, SeqTable
from pagedserve.common.blocks import cdiv
from pagedserve.common.messages.blockmgr import (
    DEFAULT_WATERMARK,
    Allocate,
    Append,
    Fork,
    Free,
    InitRequest,
    SeqResult,
    Status,
    StepReply,
    StepRequest,
    SwapIn,
    SwapOut,
)

_OK = Status.OK
_NO_ROOM = Status.NO_ROOM


def group_root(cache_salt: str | None, group: int) -> bytes:
    root = root_key(cache_salt)
    if group == 0:
        return root
    return hashlib.sha256(b"kv-group\x00" + str(group).encode() + b"\x00" + root).digest()


class HybridBlockManager(BlockManager):
    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = DEFAULT_WATERMARK,
        kv_events: bool = False,
        group_windows: list[int] | tuple[int, ...] = (0,),
    ) -> None:
        if not group_windows or any(w < 0 for w in group_windows):
            raise ValueError(f"bad KV cache group windows {group_windows!r}")
        self.windows = [int(w) for w in group_windows]  # 0: full attention
        self.G = len(self.windows)
        super().__init__(num_gpu_blocks, num_cpu_blocks, block_size, enable_prefix_caching, watermark, kv_events)

    # ---- helpers -------------------------------------------------------------

    def _ids(self, seq_id: int) -> range:
        return range(seq_id * self.G, (seq_id + 1) * self.G)

    def _tables(self, seq_id: int, on_gpu: bool = True) -> list[SeqTable]:
        if seq_id < 0:
            raise BlockManagerError(f"unknown seq_id {seq_id}")
        first = self._seq(seq_id * self.G, on_gpu)
        return [first] + [self.seqs[i] for i in self._ids(seq_id)[1:]]

    def _window_start(self, g: int, pos: int) -> int:
        """The first block group ``g`` needs for a query at ``pos``."""
        w = self.windows[g]
        return 0 if w == 0 else max(0, (pos - w + 1) // self.block_size)

    def _release(self, s: SeqTable, upto: int) -> int:
        """Null the table's blocks before index ``upto``; returns how many were freed."""
        table = s.table
        i = min(upto, len(table)) - 1
        n = 0
        unref = self.gpu.unref
        while i >= 0 and table[i] is not NULL_ENTRY:  # released entries form a prefix
            unref(table[i])
            table[i] = NULL_ENTRY
            n += 1
            i -= 1
        return n

    def group_table(self, seq_id: int, group: int) -> list[int]:
        return self.block_table(seq_id * self.G + group)

    # ---- the batched step ----------------------------------------------------

    def step(self, req: StepRequest) -> StepReply:
        if not req.continues_step:
            self.begin_step()
        results: list[SeqResult | None] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        blocked = False
        for op in req.ops:
            if type(op) is Append:
                r = self.append_hybrid(op.seq_id, op.token_ids, op.num_lookahead)
                results.append(r)
                if r is not None:
                    blocked = blocked or r.status is _NO_ROOM
            elif type(op) is Free:
                self.free_hybrid(op.seq_id)
                results.append(None)
            elif type(op) is Allocate:
                if blocked:
                    results.append(SeqResult(op.seq_id, _NO_ROOM))
                    continue
                r = self.allocate_hybrid(op.seq_id, op.token_ids, op.num_new_tokens, op.cache_salt,
                                         op.skip_prefix_lookup)
                results.append(r)
                blocked = r.status is _NO_ROOM
            elif type(op) is Fork:
                results.append(self.fork_hybrid(op.parent_seq_id, op.child_seq_id))
            elif type(op) is SwapOut:
                mapping = self.swap_out_hybrid(op.seq_ids)
                if mapping is None:
                    results.extend(SeqResult(s, _NO_ROOM) for s in op.seq_ids)
                    blocked = True
                else:
                    swap_out.extend(mapping)
                    results.extend(SeqResult(s, _OK) for s in op.seq_ids)
            elif type(op) is SwapIn:
                mapping = None if blocked else self.swap_in_hybrid(op.seq_ids)
                if mapping is None:
                    results.extend(SeqResult(s, _NO_ROOM) for s in op.seq_ids)
                    blocked = True
                else:
                    swap_in.extend(mapping)
                    results.extend(self._whole(s) for s in op.seq_ids)
            else:
                raise BlockManagerError(f"unknown op {op!r}")
        copies, self._copies = self._copies, []
        return StepReply(results, copies, swap_out, swap_in, self.stats())

    def _whole(self, seq_id: int, cached: int = 0, sched: int = 0) -> SeqResult:
        diffs = [(g, 0, [b.block_id for b in s.table]) for g, s in enumerate(self._tables(seq_id))]
        return SeqResult(seq_id, _OK, 0, list(diffs[0][2]), cached, sched, diffs)

    # ---- operations ------------------------------------------------------------

    def _lookup(self, token_ids: list[int], cache_salt: str | None) -> tuple[int, list[list[bytes]], int]:
        """(hit blocks n, each group's keys of the prompt's first full blocks, blocks queried)."""
        bs = self.block_size
        max_hits = (len(token_ids) - 1) // bs
        cached = self.gpu.cached
        keys: list[list[bytes]] = []
        for g in range(self.G):
            k = group_root(cache_salt, g)
            chain = []
            for i in range(max_hits):
                k = hash_block(k, token_ids[i * bs:(i + 1) * bs])
                chain.append(k)
            keys.append(chain)
        n = max_hits
        for g, w in enumerate(self.windows):
            if w == 0:
                m = 0
                while m < n and keys[g][m] in cached:
                    m += 1
                n = m
        while n > 0:
            if all(all(keys[g][i] in cached for i in range(self._window_start(g, n * bs), n))
                   for g, w in enumerate(self.windows) if w):
                break
            n -= 1
        return n, keys, max_hits

    def allocate_hybrid(self, seq_id: int, token_ids: list[int], num_new_tokens: int,
                        cache_salt: str | None = None, skip_prefix_lookup: bool = False) -> SeqResult:
        if seq_id < 0 or seq_id * self.G in self.seqs:
            raise BlockManagerError(f"seq_id {seq_id} already has a block table")
        if not token_ids or num_new_tokens < 0:
            raise BlockManagerError(f"seq_id {seq_id}: empty prompt or negative num_new_tokens")
        bs = self.block_size
        caching = self.enable_prefix_caching
        if caching and not skip_prefix_lookup:
            n, keys, queried = self._lookup(token_ids, cache_salt)
        else:
            n, keys, queried = 0, [], 0
        num_cached = n * bs
        num_sched = min(num_new_tokens, len(token_ids) - num_cached)
        num_blocks = cdiv(num_cached + num_sched, bs)
        cached = self.gpu.cached
        plans: list[tuple[list[Block], bytes]] = []
        need = 0
        for g in range(self.G):
            lo = self._window_start(g, num_cached)
            hits = [NULL_ENTRY] * lo + [cached[keys[g][i]] for i in range(lo, n)]
            key = keys[g][n - 1] if n else (group_root(cache_salt, g) if caching else b"")
            need += num_blocks - n + sum(1 for b in hits if b is not NULL_ENTRY and b.ref_cnt == 0)
            plans.append((hits, key))
        if self.gpu.num_free - need < self.watermark_blocks:
            return SeqResult(seq_id, _NO_ROOM)
        # Every group's hits first: a cached free block one group hits must not be
        # taken (evicted) for another group's fresh blocks.
        for hits, _ in plans:
            for b in hits:
                if b is not NULL_ENTRY:
                    self.gpu.ref(b)
        events = self.events
        diffs = []
        for g, (hits, key) in enumerate(plans):
            self.events = events if g == 0 else None  # KV events name group 0's blocks only
            try:
                r = self._install(seq_id * self.G + g, token_ids, hits, key, queried if g == 0 else 0,
                                  num_cached, num_sched, hits_reffed=True)
            finally:
                self.events = events
            if g:  # the counters count the prompt once
                self.prefix_cache_hits -= len(hits)
            diffs.append((g, 0, r.block_ids))
        return SeqResult(seq_id, _OK, 0, list(diffs[0][2]), num_cached, num_sched, diffs)

    def append_hybrid(self, seq_id: int, token_ids: list[int], num_lookahead: int = 0) -> SeqResult | None:
        tables = self._tables(seq_id)
        if num_lookahead < 0:
            raise BlockManagerError(f"seq_id {seq_id}: negative num_lookahead")
        s0 = tables[0]
        first = s0.num_tokens - s0.num_unknown  # position of the first token this append computes
        for g, s in enumerate(tables):
            if self.windows[g]:
                self._release(s, self._window_start(g, first))
        fill = min(len(token_ids), s0.num_unknown)
        k = len(token_ids) - fill + num_lookahead
        bs = self.block_size
        nt = s0.num_tokens
        if k:
            need = 0
            for s in tables:
                table = s.table
                if nt + k > len(table) * bs or (nt % bs and table[-1].ref_cnt > 1):
                    need += cdiv(nt + k, bs) - len(table) + (nt % bs != 0 and table[-1].ref_cnt > 1)
            if need > self.gpu.num_free:
                return SeqResult(seq_id, _NO_ROOM)
        events = self.events
        diffs = []
        for g in range(self.G):
            self.events = events if g == 0 else None
            try:
                r = self.append_slots(seq_id * self.G + g, token_ids, num_lookahead)
            finally:
                self.events = events
            if r is not None:
                assert r.status is _OK
                diffs.append((g, r.table_start, r.block_ids))
        if not diffs:
            return None
        d0 = diffs[0] if diffs[0][0] == 0 else (0, len(s0.table), [])
        return SeqResult(seq_id, _OK, d0[1], list(d0[2]), 0, k, diffs)

    def fork_hybrid(self, parent_seq_id: int, child_seq_id: int) -> SeqResult:
        self._tables(parent_seq_id)
        if child_seq_id < 0 or child_seq_id * self.G in self.seqs:
            raise BlockManagerError(f"seq_id {child_seq_id} already has a block table")
        for g in range(self.G):
            self.fork(parent_seq_id * self.G + g, child_seq_id * self.G + g)
        return self._whole(child_seq_id)

    def free_hybrid(self, seq_id: int) -> None:
        self._tables(seq_id, on_gpu=False)
        for i in self._ids(seq_id):
            self.free(i)

    def _group_ids(self, seq_ids: list[int]) -> list[int]:
        if len(set(seq_ids)) != len(seq_ids):
            raise BlockManagerError(f"duplicate seq ids in group {seq_ids}")
        for s in seq_ids:
            self._tables(s, on_gpu=False)
        return [i for s in seq_ids for i in self._ids(s)]

    def swap_out_hybrid(self, seq_ids: list[int]) -> list[tuple[int, int]] | None:
        return self.swap_out(self._group_ids(seq_ids))

    def swap_in_hybrid(self, seq_ids: list[int]) -> list[tuple[int, int]] | None:
        return self.swap_in(self._group_ids(seq_ids))

    # ---- introspection -----------------------------------------------------------

    def stats(self):  # type: ignore[no-untyped-def]
        st = super().stats()
        st.num_seqs = len(self.seqs) // self.G
        return st

    def check_integrity(self) -> None:
        super().check_integrity()
        G = self.G
        for i, s in self.seqs.items():
            g = i % G
            s0 = self.seqs.get(i - g)
            if s0 is None or s0.num_tokens != s.num_tokens or s0.on_cpu != s.on_cpu:
                raise AssertionError(f"seq {i // G}: group {g} disagrees with group 0")
            nulls = sum(1 for b in s.table if b is NULL_ENTRY)
            if any(b is NULL_ENTRY for b in s.table[nulls:]):
                raise AssertionError(f"seq {i // G}: group {g} has a released block after a held one")
            if nulls and not self.windows[g]:
                raise AssertionError(f"seq {i // G}: full group {g} released blocks")
            if nulls > self._window_start(g, s.num_tokens - s.num_unknown):
                raise AssertionError(f"seq {i // G}: group {g} released a block inside its window")


def make_block_manager(init: InitRequest, kv_events: bool = False) -> BlockManager:
    """The manager an ``InitRequest`` asks for: hybrid when it names KV cache groups."""
    if init.kv_group_windows:
        return HybridBlockManager(init.num_gpu_blocks, init.num_cpu_blocks, init.block_size,
                                  init.enable_prefix_caching, init.watermark, kv_events, init.kv_group_windows)
    return BlockManager(init.num_gpu_blocks, init.num_cpu_blocks, init.block_size, init.enable_prefix_caching,
                        init.watermark, kv_events=kv_events)
