"""The paged KV memory manager (PagedAttention paper, section 4.2-4.5).

``BlockManager`` is a pure class (no sockets): the scheduler's whole step
arrives as one ``StepRequest`` and leaves as one ``StepReply``. It keeps
every sequence's block table, shares blocks by reference count (fork,
prefix caching), copies-on-write a shared, partly filled last block and
moves whole sequence groups between the GPU and the CPU pool.

Conventions
* GPU block 0 is the null block: never handed out, so the worker may pad
  block tables and slot mappings with it. ``BlockStats.num_gpu_blocks``
  counts usable blocks (``num_gpu_blocks - 1``), so ``kv_usage`` is exact.
  CPU blocks are all usable.
* A full block is keyed by sha256(parent key + its token ids); the chain's
  root is the empty key, or sha256 of the request's cache salt. A block
  filled by this step becomes a prefix-cache hit from the next step's
  first request on (``continues_step`` False), because its K/V is written
  by this step's forward pass; extra rounds of the same step (preemption,
  ``continues_step`` True) do not commit, and a block freed before the
  commit is never cached.
* ``StepReply.results`` pairs with the ops: one entry per sequence an op
  names, in order (Fork: the child; SwapOut/SwapIn: each of the group).
  ``None`` means applied with the GPU block table unchanged (every Free, an
  Append that needed no new block); anything else is a ``SeqResult``.
* Swaps move a whole group (``swap.py``); prefix-cache keys are computed in
  ``prefix_cache.py``; each table is a ``seq_table.SeqTable``. The blockmgr
  owns the block tables; the scheduler and the worker keep copies built only
  from the diffs it answers (docs/architecture.md, "Who owns what").
* Only the blockmgr knows the watermark: ``BlockStats.num_admissible_gpu_blocks``
  tells the scheduler how many free blocks admissions may take.
* The worker must run, before the forward pass: ``swap_out`` copies, then
  ``swap_in`` copies, then ``copies`` (CoW); a block freed or swapped out
  earlier in the step may be the destination of a later op.
"""
from __future__ import annotations

from pagedserve.blockmgr.block_pool import Block, BlockPool
from pagedserve.blockmgr.prefix_cache import hash_block, lookup_prefix, root_key
from pagedserve.blockmgr.seq_table import NULL_ENTRY, BlockManagerError, SeqTable
from pagedserve.blockmgr.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVEventBatch, KVEventLog
from pagedserve.blockmgr.swap import SwapOps
from pagedserve.common.blocks import NULL_BLOCK, NUM_RESERVED_GPU_BLOCKS, cdiv, usable_gpu_blocks
from pagedserve.common.messages.blockmgr import (
    DEFAULT_WATERMARK,
    Allocate,
    Append,
    BlockStats,
    Fork,
    Free,
    SeqResult,
    Status,
    StepReply,
    StepRequest,
    SwapIn,
    SwapOut,
)

__all__ = ["NULL_BLOCK", "BlockManager", "BlockManagerError", "hash_block"]

_OK = Status.OK
_NO_ROOM = Status.NO_ROOM


class BlockManager(SwapOps):
    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = DEFAULT_WATERMARK,
        kv_events: bool = False,
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is the null block)")
        if num_cpu_blocks < 0 or block_size < 1 or not 0.0 <= watermark < 1.0:
            raise ValueError("bad num_cpu_blocks, block_size or watermark")
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        self.watermark_blocks = int(watermark * usable_gpu_blocks(num_gpu_blocks))
        # vLLM-format KV events of the prefix cache's changes (kv_events.py); the service publishes them
        self.events = KVEventLog(block_size) if kv_events and enable_prefix_caching else None
        self.reset()

    def reset(self) -> None:
        if self.events is not None:
            self.events.cleared()
        self.gpu = BlockPool(self.num_gpu_blocks, NUM_RESERVED_GPU_BLOCKS, MEDIUM_GPU, self.events)
        self.cpu = BlockPool(self.num_cpu_blocks, 0, MEDIUM_CPU, self.events)
        self.seqs: dict[int, SeqTable] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._pending: list[Block] = []  # filled this step, cached at the next
        self._copies: list[tuple[int, int]] = []
        # CoW destinations of the current step -> the block whose content they
        # will receive; a swap-out in the same step copies from there, since
        # the worker runs swap_out before copies
        self._cow_src: dict[int, int] = {}
        self._swapin_src: dict[int, Block] = {}  # GPU block swapped in this step -> its CPU source
        self._step_no = 0

    # ---- the batched step -------------------------------------------------

    def step(self, req: StepRequest) -> StepReply:
        if not req.continues_step:
            self.begin_step()
        results: list[SeqResult | None] = []  # one per sequence an op names, in order
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        blocked = False  # after the first NO_ROOM, admissions wait (FCFS)
        append_slots = self.append_slots
        for op in req.ops:
            if type(op) is Append:
                r = append_slots(op.seq_id, op.token_ids, op.num_lookahead)
                results.append(r)
                if r is not None:
                    blocked = blocked or r.status is _NO_ROOM
            elif type(op) is Free:
                self.free(op.seq_id)
                results.append(None)
            elif type(op) is Allocate:
                if blocked:
                    results.append(SeqResult(op.seq_id, _NO_ROOM))
                    continue
                r = self.allocate(op.seq_id, op.token_ids, op.num_new_tokens, op.cache_salt, op.skip_prefix_lookup)
                results.append(r)
                blocked = r.status is _NO_ROOM
            elif type(op) is Fork:
                results.append(self.fork(op.parent_seq_id, op.child_seq_id))
            elif type(op) is SwapOut:
                mapping = self.swap_out(op.seq_ids)
                if mapping is None:
                    results.extend(SeqResult(s, _NO_ROOM) for s in op.seq_ids)
                    blocked = True
                else:
                    swap_out.extend(mapping)
                    results.extend(SeqResult(s, _OK) for s in op.seq_ids)
            elif type(op) is SwapIn:
                mapping = None if blocked else self.swap_in(op.seq_ids)
                if mapping is None:
                    results.extend(SeqResult(s, _NO_ROOM) for s in op.seq_ids)
                    blocked = True
                else:
                    swap_in.extend(mapping)
                    results.extend(
                        SeqResult(s, _OK, 0, [b.block_id for b in self.seqs[s].table]) for s in op.seq_ids
                    )
            else:
                raise BlockManagerError(f"unknown op {op!r}")
        copies, self._copies = self._copies, []
        return StepReply(results, copies, swap_out, swap_in, self.stats())

    def begin_step(self) -> None:
        """The previous step's copies and forward pass have run: the blocks
        it filled become prefix-cache hits, held blocks become free."""
        self._step_no += 1
        self._cow_src.clear()
        self._swapin_src.clear()
        self.gpu.end_step()
        self.cpu.end_step()
        if self._pending:
            commit = self.gpu.commit
            for b in self._pending:
                commit(b)
            self._pending = []
        if self.events is not None:
            self.events.forget_uncached()

    def take_kv_events(self) -> KVEventBatch | None:
        """The KV events since the last call, as one vLLM ``KVEventBatch``."""
        return self.events.take_batch() if self.events is not None else None

    # ---- fine-grained operations -------------------------------------------

    def _seq(self, seq_id: int, on_gpu: bool = True) -> SeqTable:
        s = self.seqs.get(seq_id)
        if s is None:
            raise BlockManagerError(f"unknown seq_id {seq_id}")
        if on_gpu and s.on_cpu:
            raise BlockManagerError(f"seq_id {seq_id} is swapped out")
        return s

    def _plan_allocate(
        self, seq_id: int, token_ids: list[int], num_new_tokens: int, cache_salt: str | None,
        skip_lookup: bool = False,
    ) -> tuple[list[Block], bytes, int, int, int, int]:
        if not token_ids or num_new_tokens < 0:
            raise BlockManagerError(f"seq_id {seq_id}: empty prompt or negative num_new_tokens")
        if self.enable_prefix_caching and skip_lookup:
            hits, key, queried = [], root_key(cache_salt), 0
        elif self.enable_prefix_caching:
            hits, key, queried = lookup_prefix(self.gpu.cached, token_ids, root_key(cache_salt), self.block_size)
        else:
            hits, key, queried = [], b"", 0
        num_cached = len(hits) * self.block_size
        num_sched = min(num_new_tokens, len(token_ids) - num_cached)
        num_blocks = cdiv(num_cached + num_sched, self.block_size)
        revived = sum(1 for b in hits if b.ref_cnt == 0)  # leave the free queue
        need = num_blocks - len(hits) + revived
        return hits, key, queried, num_cached, num_sched, need

    def can_allocate(self, token_ids: list[int], num_new_tokens: int, cache_salt: str | None = None) -> bool:
        *_, need = self._plan_allocate(0, token_ids, num_new_tokens, cache_salt)
        return self.gpu.num_free - need >= self.watermark_blocks

    def allocate(
        self, seq_id: int, token_ids: list[int], num_new_tokens: int, cache_salt: str | None = None,
        skip_prefix_lookup: bool = False,
    ) -> SeqResult:
        if seq_id in self.seqs:
            raise BlockManagerError(f"seq_id {seq_id} already has a block table")
        hits, key, queried, num_cached, num_sched, need = self._plan_allocate(
            seq_id, token_ids, num_new_tokens, cache_salt, skip_prefix_lookup
        )
        if self.gpu.num_free - need < self.watermark_blocks:
            return SeqResult(seq_id, _NO_ROOM)
        return self._install(seq_id, token_ids, hits, key, queried, num_cached, num_sched)

    def _install(
        self, seq_id: int, token_ids: list[int], hits: list[Block], key: bytes, queried: int,
        num_cached: int, num_sched: int, hits_reffed: bool = False,
    ) -> SeqResult:
        """The table of an admitted prompt: ``hits`` (cached blocks, or
        NULL_ENTRY before a sliding window; already referenced when
        ``hits_reffed``), then fresh blocks; room checked."""
        gpu = self.gpu
        if not hits_reffed:
            for b in hits:
                if b is not NULL_ENTRY:
                    gpu.ref(b)
        bs = self.block_size
        total = num_cached + num_sched
        table = hits + [gpu.take() for _ in range(cdiv(total, bs) - len(hits))]
        tail: list[int] = []
        if self.enable_prefix_caching:
            self.prefix_cache_queries += queried
            self.prefix_cache_hits += len(hits)
            for i in range(len(hits), total // bs):  # blocks this step fills
                parent, key = key, hash_block(key, token_ids[i * bs:(i + 1) * bs])
                if self.events is not None:
                    self.events.keyed(key, parent, token_ids[i * bs:(i + 1) * bs])
                table[i].pending_hash = key
                self._pending.append(table[i])
            tail = token_ids[(total // bs) * bs:total]
        self.seqs[seq_id] = SeqTable(table, total, tail, key)
        return SeqResult(seq_id, _OK, 0, [b.block_id for b in table], num_cached, num_sched)

    def append_slots(self, seq_id: int, token_ids: list[int], num_lookahead: int = 0) -> SeqResult | None:
        """Slots for ``token_ids`` (the first of which fill the slots reserved
        for unknown tokens) and ``num_lookahead`` more; None when the block
        table is unchanged."""
        s = self.seqs.get(seq_id)
        if s is None or s.on_cpu:
            self._seq(seq_id)  # raises the right error
        assert s is not None
        if num_lookahead < 0:
            raise BlockManagerError(f"seq_id {seq_id}: negative num_lookahead")
        unknown = s.num_unknown
        fill = min(len(token_ids), unknown)
        k = len(token_ids) - fill + num_lookahead
        if k == 0 and not token_ids:
            return None
        bs = self.block_size
        table = s.table
        nt = s.num_tokens
        result: SeqResult | None = None
        st = s.step_start
        if st is None or st[0] != self._step_no:  # the first Append of this step: snapshot (seq_table.StepStart)
            s.step_start = (self._step_no, nt, s.last_key, list(s.tail), unknown)
        if k and (nt + k > len(table) * bs or (nt % bs and table[-1].ref_cnt > 1)):
            gpu = self.gpu
            cow = nt % bs != 0 and table[-1].ref_cnt > 1
            new = cdiv(nt + k, bs) - len(table)
            if gpu.num_free < new + cow:
                return SeqResult(seq_id, _NO_ROOM)
            start = len(table)
            if cow:  # the last block is shared and partly filled: copy it
                src = table[-1]
                dst = gpu.take()
                self._copies.append((src.block_id, dst.block_id))
                self._cow_src[dst.block_id] = self._cow_src.get(src.block_id, src.block_id)
                gpu.hold_ids.add(src.block_id)
                gpu.hold_ids.add(dst.block_id)
                gpu.unref(src)
                table[-1] = dst
                start -= 1
            for _ in range(new):
                table.append(gpu.take())
            result = SeqResult(seq_id, _OK, start, [b.block_id for b in table[start:]], 0, k)
        s.num_tokens = nt + k
        s.num_unknown = unknown - fill + num_lookahead
        if self.enable_prefix_caching and token_ids:
            tail = s.tail
            i = (nt - unknown - len(tail)) // bs  # the block the tail's tokens are in
            tail.extend(token_ids)
            if len(tail) >= bs:  # one or more blocks filled: key them
                key = s.last_key
                while len(tail) >= bs:
                    parent, key = key, hash_block(key, tail[:bs])
                    if self.events is not None:
                        self.events.keyed(key, parent, tail[:bs])
                    b = table[i]
                    b.pending_hash = key
                    self._pending.append(b)
                    del tail[:bs]
                    i += 1
                s.last_key = key
        return result

    def fork(self, parent_seq_id: int, child_seq_id: int) -> SeqResult:
        p = self._seq(parent_seq_id)
        if child_seq_id in self.seqs:
            raise BlockManagerError(f"seq_id {child_seq_id} already has a block table")
        ref = self.gpu.ref
        for b in p.table:
            if b is not NULL_ENTRY:
                ref(b)
        start = p.start_of(self._step_no)
        self.seqs[child_seq_id] = SeqTable(list(p.table), p.num_tokens, list(p.tail), p.last_key,
                                           step_start=None if start is None else (*start[:3], list(start[3]), start[4]),
                                           num_unknown=p.num_unknown)
        return SeqResult(child_seq_id, _OK, 0, [b.block_id for b in p.table])

    def free(self, seq_id: int) -> None:
        s = self._seq(seq_id, on_gpu=False)
        del self.seqs[seq_id]
        unref = (self.cpu if s.on_cpu else self.gpu).unref
        for b in reversed(s.table):  # tail first: evicted before the chain's head
            if b is not NULL_ENTRY:
                unref(b)

    # ---- introspection ------------------------------------------------------

    def block_table(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self._seq(seq_id, on_gpu=False).table]

    def stats(self) -> BlockStats:
        return BlockStats(
            self.gpu.num_usable,
            self.gpu.num_free,
            self.cpu.num_usable,
            self.cpu.num_free,
            len(self.seqs),
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.gpu.num_shared_refs,
            self.gpu.num_free - self.watermark_blocks,
        )

    def check_integrity(self) -> None:
        """Raise AssertionError unless every invariant holds."""
        bs = self.block_size
        refs: tuple[dict[int, int], dict[int, int]] = ({}, {})
        for seq_id, s in self.seqs.items():
            ids = [b.block_id for b in s.table if b is not NULL_ENTRY]
            if len(set(ids)) != len(ids):
                raise AssertionError(f"seq {seq_id}: a block appears twice in its table {ids}")
            if len(s.table) != cdiv(s.num_tokens, bs):
                raise AssertionError(f"seq {seq_id}: {len(s.table)} blocks for {s.num_tokens} tokens")
            pool = self.cpu if s.on_cpu else self.gpu
            for b in s.table:
                if b is not NULL_ENTRY and pool.blocks[b.block_id] is not b:
                    raise AssertionError(f"seq {seq_id}: block {b.block_id} is not from the {'CPU' if s.on_cpu else 'GPU'} pool")
            counts = refs[s.on_cpu]
            for i in ids:
                counts[i] = counts.get(i, 0) + 1
            if not 0 <= s.num_unknown <= s.num_tokens:
                raise AssertionError(f"seq {seq_id}: {s.num_unknown} unknown of {s.num_tokens} tokens")
            known = s.num_tokens - s.num_unknown
            if self.enable_prefix_caching and len(s.tail) != known % bs:
                raise AssertionError(f"seq {seq_id}: {len(s.tail)} tail tokens for {known} known tokens")
        self.gpu.check("gpu", refs[0])
        self.cpu.check("cpu", refs[1])
        for b in self.cpu.blocks:
            if b.pending_hash is not None:
                raise AssertionError(f"cpu block {b.block_id} has a pending prefix-cache key")
        for b in self._pending:
            if b.pending_hash is not None and b.ref_cnt == 0:
                raise AssertionError(f"free block {b.block_id} still waits to be cached")
