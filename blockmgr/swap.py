"""Swapping whole sequence groups between the GPU and the CPU pool.

A block shared inside a group moves once and stays shared. Each pool keeps
its own prefix-key map, so a swap reuses, without a copy, a block whose
content the destination pool still holds. The worker runs swap-outs first,
then swap-ins, then CoW copies, so a swap-out copies a CoW destination of
this step from its source.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.blockmgr.block_pool import Block, BlockPool
from pagedserve.blockmgr.seq_table import NULL_ENTRY, BlockManagerError, SeqTable
from pagedserve.common.blocks import cdiv


class SwapOps:
    """Mixed into ``BlockManager``: the state it reads is the manager's."""

    gpu: BlockPool
    cpu: BlockPool
    seqs: dict[int, SeqTable]
    block_size: int
    watermark_blocks: int
    _step_no: int
    _pending: list[Block]
    _cow_src: dict[int, int]
    _swapin_src: dict[int, Block]

    if TYPE_CHECKING:  # provided by the class this is mixed into
        def _seq(self, seq_id: int, on_gpu: bool = True) -> SeqTable: ...

    def _group(self, seq_ids: list[int], on_cpu: bool) -> list[SeqTable]:
        if len(set(seq_ids)) != len(seq_ids):
            raise BlockManagerError(f"duplicate seq ids in group {seq_ids}")
        group = [self._seq(i, on_gpu=False) for i in seq_ids]
        for i, s in zip(seq_ids, group):
            if s.on_cpu != on_cpu:
                raise BlockManagerError(f"seq_id {i} is {'on the GPU' if not s.on_cpu else 'swapped out'}")
        return group

    def _blocks_before_step(self, s: SeqTable) -> int:
        """Blocks a swap-out keeps: those holding tokens from before this
        step's Appends (a sequence swapped out does not run this step)."""
        start = s.start_of(self._step_no)
        return cdiv(start[1], self.block_size) if start is not None else len(s.table)

    def _rollback_step(self, s: SeqTable) -> None:
        """Give back the slots this step's Appends reserved for ``s``."""
        start = s.start_of(self._step_no)
        if start is None:
            return
        _, nt0, key0, tail0, unknown0 = start
        bs = self.block_size
        keep = cdiv(nt0, bs)
        for b in s.table[(nt0 - unknown0) // bs:(s.num_tokens - s.num_unknown) // bs]:
            b.pending_hash = None  # keyed by tokens that will not be computed
        for b in reversed(s.table[keep:]):
            self.gpu.unref(b)
        del s.table[keep:]
        s.num_tokens, s.last_key, s.tail, s.num_unknown = nt0, key0, tail0, unknown0
        s.step_start = None

    def _existing(self, b: Block, dst: BlockPool) -> Block | None:
        """A ``dst`` block that holds (or by the swap-outs' time will hold)
        ``b``'s content without a copy, if any."""
        if dst is self.cpu:
            c = self._swapin_src.get(self._cow_src.get(b.block_id, b.block_id))
            if c is not None:  # swapped in this step: its CPU source is still intact (held)
                return c
        return dst.cached.get(b.block_hash) if b.block_hash is not None else None

    def _need(self, group: list[SeqTable], dst: BlockPool) -> int:
        """Free ``dst`` blocks a move takes: one per distinct block of the
        group, unless ``dst`` already holds its content."""
        need = 0
        seen: set[int] = set()
        out = dst is self.cpu
        for s in group:
            for b in s.table[: self._blocks_before_step(s)] if out else s.table:
                if b is NULL_ENTRY or b.block_id in seen:
                    continue
                seen.add(b.block_id)
                d = self._existing(b, dst)
                if d is None or (d.ref_cnt == 0 and not d.held):
                    need += 1
        return need

    def _move(self, group: list[SeqTable], src: BlockPool, dst: BlockPool) -> list[tuple[int, int]]:
        """Give each distinct block of the group one block in ``dst``."""
        moved: dict[int, Block] = {}
        mapping: list[tuple[int, int]] = []
        to_gpu = dst is self.gpu
        for s in group:
            new_table = []
            for b in s.table:
                if b is NULL_ENTRY:  # released by a sliding-window group: stays released
                    new_table.append(b)
                    continue
                d = moved.get(b.block_id)
                if d is None:
                    d = self._existing(b, dst)
                if d is not None:
                    dst.ref(d)
                else:
                    d = dst.take()
                    key = b.block_hash
                    if to_gpu:
                        mapping.append((b.block_id, d.block_id))
                        self._swapin_src[d.block_id] = b
                        src.hold_ids.add(b.block_id)  # read by the swap-in: keep it this step
                        if key is not None:  # cached once the copy has run (next step)
                            d.pending_hash = key
                            self._pending.append(d)
                    else:
                        mapping.append((self._cow_src.get(b.block_id, b.block_id), d.block_id))
                        if key is not None:  # swap-outs run before anything reuses it
                            dst.register(d, key)
                moved[b.block_id] = d
                new_table.append(d)
            for b in reversed(s.table):
                if b is not NULL_ENTRY:
                    src.unref(b)
            s.table = new_table
            s.on_cpu = not to_gpu
        return mapping

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]] | None:
        """(gpu, cpu) pairs to copy, or None when the CPU pool has no room.
        Slots this step's Appends reserved for the group are given back."""
        group = self._group(seq_ids, on_cpu=False)
        if self._need(group, self.cpu) > self.cpu.num_free:
            return None
        for s in group:
            self._rollback_step(s)
        return self._move(group, self.gpu, self.cpu)

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]] | None:
        """(cpu, gpu) pairs to copy, or None when the GPU pool has no room."""
        group = self._group(seq_ids, on_cpu=True)
        if self.gpu.num_free - self._need(group, self.gpu) < self.watermark_blocks:
            return None
        return self._move(group, self.cpu, self.gpu)
