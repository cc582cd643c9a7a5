"""The worker's per-sequence state and the one place an ``ExecuteStep``'s
bookkeeping is applied, shared by the model worker and the simulated one.

Order (docs/architecture.md, "One engine step"): drop finished sequences,
add new ones, apply block-table diffs, then swap out, swap in and copy (a
block released by an earlier op may be a later op's destination). After the
forward, ``finish_step`` advances the computed counts and appends the
sampled tokens. No torch here: the simulated worker runs without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.common.messages.types import SamplingParams
from pagedserve.common.messages.worker import ExecuteStep, NewSeq, SampledToken


@dataclass
class SeqState:
    seq_id: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    num_prompt_tokens: int
    # A hybrid KV cache's tables, one per group (the first is ``block_ids``); empty for dense models.
    group_tables: list[list[int]] = field(default_factory=list)


class KVPool(Protocol):
    """What a step asks of a KV pool before its forward."""

    num_gpu_blocks: int

    def swap_out(self, pairs: list[tuple[int, int]]) -> None: ...
    def swap_in(self, pairs: list[tuple[int, int]]) -> None: ...
    def copy(self, pairs: list[tuple[int, int]]) -> None: ...


def check_blocks(seq_id: int, block_ids: list[int], num_blocks: int) -> None:
    """Once per block id, when it arrives: the forward indexes the pool with it
    (an id out of range would be a device-side assert on CUDA, not an error)."""
    if block_ids and not (0 <= min(block_ids) and max(block_ids) < num_blocks):
        raise ValueError(f"seq {seq_id}: block id outside the pool of {num_blocks}")


class SeqStates:
    def __init__(self, num_kv_groups: int = 1) -> None:
        self.seqs: dict[int, SeqState] = {}
        self.num_kv_groups = num_kv_groups  # > 1: a hybrid KV cache, one table per group

    def clear(self) -> None:
        self.seqs.clear()

    def get(self, seq_id: int) -> SeqState:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown seq {seq_id} (never sent as NewSeq, or already finished)") from None

    def _add(self, new: NewSeq) -> None:
        if new.seq_id in self.seqs:
            # The scheduler drops a sequence (``finished``, applied first) before it
            # re-sends it after a recompute preemption; a second NewSeq is a bug.
            raise ValueError(f"seq {new.seq_id} sent as new while the worker holds it")
        if not new.token_ids:
            raise ValueError(f"seq {new.seq_id}: empty token_ids")
        if not 0 <= new.num_computed_tokens < len(new.token_ids):
            raise ValueError(f"seq {new.seq_id}: num_computed_tokens {new.num_computed_tokens} "
                             f"outside [0, {len(new.token_ids)})")
        # An empty table: this step's block diffs (applied after new_seqs) fill it.
        st = SeqState(new.seq_id, list(new.token_ids), [], new.num_computed_tokens, new.params,
                      new.num_prompt_tokens)
        if self.num_kv_groups > 1:
            st.group_tables = [st.block_ids] + [[] for _ in range(self.num_kv_groups - 1)]
        self.seqs[new.seq_id] = st

    def apply(self, step: ExecuteStep, pool: KVPool) -> list[tuple[SeqState, int]]:
        """Everything of ``step`` before the forward; returns (state, tokens to compute) in batch order."""
        for seq_id in step.finished:
            self.seqs.pop(seq_id, None)
        for new in step.new_seqs:
            self._add(new)
        for diff in step.block_diffs:
            seq = self.get(diff.seq_id)
            if diff.group:
                if not 0 < diff.group < len(seq.group_tables):
                    raise ValueError(f"seq {diff.seq_id}: block diff for KV cache group {diff.group} "
                                     f"of {max(1, len(seq.group_tables))}")
                table = seq.group_tables[diff.group]
            else:
                table = seq.block_ids
            if diff.table_start > len(table):
                raise ValueError(f"seq {diff.seq_id}: block diff starts at {diff.table_start} "
                                 f"past its table of {len(table)}")
            check_blocks(diff.seq_id, diff.block_ids, pool.num_gpu_blocks)
            del table[diff.table_start:]
            table.extend(diff.block_ids)
        pool.swap_out(step.swap_out)
        pool.swap_in(step.swap_in)
        pool.copy(step.copies)
        seqs = self.seqs
        try:  # the hot path: one lookup per scheduled sequence, no call
            return [(seqs[s.seq_id], s.num_tokens) for s in step.scheduled]
        except KeyError as e:
            self.get(e.args[0])  # raises the protocol error
            raise

    def finish_step(self, scheduled: list[tuple[SeqState, int]], sampled: list[SampledToken]) -> None:
        """After the forward: the scheduled tokens are computed, the sampled ones appended."""
        for seq, n in scheduled:
            seq.num_computed_tokens += n
        for tok in sampled:
            self.seqs[tok.seq_id].token_ids.append(tok.token_id)
