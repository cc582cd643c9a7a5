"""Contiguous KV reservation, the Orca baselines of the paper (section 6.1),
behind the same ``step(StepRequest) -> StepReply`` interface as our paged
``BlockManager``, so the SAME scheduler runs unchanged on top of it.

At admission (``Allocate``) a sequence reserves one contiguous range of
slots for its whole life, sized by the policy from its TRUE lengths (the
baselines are given them: that is what makes Pow2 and Oracle oracles):

* ``orca_max``:    2048 slots (the maximum sequence length);
* ``orca_pow2``:   prompt + next power of two of the output length;
* ``orca_oracle``: prompt + output length exactly;

placed by the binary buddy allocator of ``bench memory`` over the same
slot space (so every reservation is rounded up to a power of two, and
Max fits 7 sequences in 15,728 slots). Reservations are at least one
block (16 slots), so block tables stay block-aligned; the block table a
sequence gets is the whole range, at once.

Appends within the reservation never fail (so the scheduler never has to
preempt); an admission that finds no range answers ``NO_ROOM`` and, as in
``BlockManager``, so does every later admission of the step (FCFS).
No sharing, no swapping: ``Fork``/``SwapOut``/``SwapIn`` are refused.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.bench.memory import MAX_LEN, BuddyAllocator, next_pow2
from pagedserve.bench.workloads import RequestLen
from pagedserve.common.blocks import NUM_RESERVED_GPU_BLOCKS, cdiv, usable_gpu_blocks
from pagedserve.common.messages.blockmgr import (
    Allocate,
    Append,
    BlockStats,
    Free,
    SeqResult,
    Status,
    StepReply,
    StepRequest,
)

POLICIES = ("orca_max", "orca_pow2", "orca_oracle")


class ContiguousError(ValueError):
    """A protocol error, or a sequence that outgrew its true length."""


@dataclass
class _Reservation:
    offset: int  # first slot (in the space without the null block)
    order: int  # the buddy block is 2**order slots
    capacity: int  # slots the policy asked for (<= 2**order)
    num_tokens: int


class ContiguousBlockManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, policy: str,
                 lengths: Callable[[list[int]], RequestLen], max_len: int = MAX_LEN) -> None:
        """``lengths(token_ids)`` gives the true (prompt, output) lengths of the
        request whose prompt (possibly followed by generated tokens) is
        ``token_ids``; the bench encodes the request in the prompt."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.policy = policy
        self.lengths = lengths
        self.max_len = max_len
        self.num_slots = usable_gpu_blocks(num_gpu_blocks) * block_size  # the null block kept out, as in BlockManager
        self.reset()

    def reset(self) -> None:
        self.buddy = BuddyAllocator(self.num_slots)
        self.seqs: dict[int, _Reservation] = {}
        self.num_no_room = 0

    def reservation_size(self, r: RequestLen) -> int:
        """Slots the policy reserves (``bench memory``'s ``reserve`` at
        max_len 2048), at least one block."""
        if self.policy == "orca_max":
            size = self.max_len
        elif self.policy == "orca_pow2":
            size = min(self.max_len, r.prompt_len + next_pow2(r.output_len))
        else:
            size = r.total
        return max(self.block_size, size)

    # ---- the batched step -------------------------------------------------

    def step(self, req: StepRequest) -> StepReply:
        results: list[SeqResult | None] = []  # pairs with the ops (messages/blockmgr.py)
        blocked = False  # after the first NO_ROOM, admissions wait (FCFS)
        for op in req.ops:
            if type(op) is Append:
                self.append(op.seq_id, len(op.token_ids))
                results.append(None)  # the table never changes
            elif type(op) is Free:
                self.free(op.seq_id)
                results.append(None)
            elif type(op) is Allocate:
                r = SeqResult(op.seq_id, Status.NO_ROOM) if blocked else self.allocate(op)
                results.append(r)
                blocked = r.status is Status.NO_ROOM
            else:
                raise ContiguousError(f"{type(op).__name__} is not supported by contiguous reservation")
        return StepReply(results, [], [], [], self.stats())

    def allocate(self, op: Allocate) -> SeqResult:
        if op.seq_id in self.seqs:
            raise ContiguousError(f"seq_id {op.seq_id} already has a reservation")
        if not op.token_ids or op.num_new_tokens < 0:
            raise ContiguousError(f"seq_id {op.seq_id}: empty prompt or negative num_new_tokens")
        size = self.reservation_size(self.lengths(op.token_ids))
        if size < len(op.token_ids):
            raise ContiguousError(f"seq_id {op.seq_id}: {len(op.token_ids)} tokens exceed its true length")
        offset = self.buddy.alloc(size)
        if offset is None:
            self.num_no_room += 1
            return SeqResult(op.seq_id, Status.NO_ROOM)
        num = min(op.num_new_tokens, len(op.token_ids))
        res = self.seqs[op.seq_id] = _Reservation(offset, self.buddy.order(size), size, num)
        return SeqResult(op.seq_id, Status.OK, 0, self._block_ids(res), 0, num)

    def append(self, seq_id: int, num_tokens: int) -> None:
        res = self.seqs.get(seq_id)
        if res is None:
            raise ContiguousError(f"unknown seq_id {seq_id}")
        if res.num_tokens + num_tokens > res.capacity:
            raise ContiguousError(f"seq_id {seq_id}: {res.num_tokens + num_tokens} tokens outgrow its "
                                  f"{res.capacity}-slot reservation (wrong true length?)")
        res.num_tokens += num_tokens

    def free(self, seq_id: int) -> None:
        res = self.seqs.pop(seq_id, None)
        if res is None:
            raise ContiguousError(f"unknown seq_id {seq_id}")
        self.buddy.release(res.offset, res.order)

    def _block_ids(self, res: _Reservation) -> list[int]:
        first = NUM_RESERVED_GPU_BLOCKS + res.offset // self.block_size
        return list(range(first, first + cdiv(res.capacity, self.block_size)))

    # ---- introspection ------------------------------------------------------

    def block_table(self, seq_id: int) -> list[int]:
        return self._block_ids(self.seqs[seq_id])

    def stats(self) -> BlockStats:
        free = self.buddy.free_slots // self.block_size
        # No watermark: every free block is open to admission.
        return BlockStats(usable_gpu_blocks(self.num_gpu_blocks), free, 0, 0, len(self.seqs), num_admissible_gpu_blocks=free)

    def slot_usage(self) -> dict[str, int]:
        """Slots holding tokens, reserved by policy but unused, and lost to
        buddy rounding, right now."""
        tokens = sum(r.num_tokens for r in self.seqs.values())
        asked = sum(r.capacity for r in self.seqs.values())
        held = sum(1 << r.order for r in self.seqs.values())
        return {"tokens": tokens, "reserved": asked - tokens, "rounding": held - asked,
                "free": self.buddy.free_slots}

    def check_integrity(self) -> None:
        """Raise AssertionError unless reservations are disjoint, aligned,
        within their capacity and the free space adds up."""
        held = 0
        spans = []
        for seq_id, r in self.seqs.items():
            size = 1 << r.order
            if r.offset % size or r.offset % self.block_size:
                raise AssertionError(f"seq {seq_id}: offset {r.offset} not aligned to {size}")
            if not r.num_tokens <= r.capacity <= size:
                raise AssertionError(f"seq {seq_id}: {r.num_tokens} tokens, capacity {r.capacity}, block {size}")
            spans.append((r.offset, r.offset + size))
            held += size
        spans.sort()
        for (a0, a1), (b0, _) in zip(spans, spans[1:]):
            if b0 < a1:
                raise AssertionError(f"reservations overlap: [{a0}, {a1}) and [{b0}, ...)")
        if spans and spans[-1][1] > self.num_slots:
            raise AssertionError("a reservation ends past the slot space")
        free = sum(len(offs) << k for k, offs in self.buddy.free.items())
        if held + free != self.num_slots or free != self.buddy.free_slots:
            raise AssertionError(f"{held} held + {free} free != {self.num_slots} slots "
                                 f"(buddy says {self.buddy.free_slots} free)")
