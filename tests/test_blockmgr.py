"""BlockManager unit tests with exact expected block ids.

Pools are tiny: 9 GPU blocks (block 0 is the null block, so 1..8 are
handed out, head of the free queue first) and 4 CPU blocks, block size 4.
"""
from __future__ import annotations

import pytest

from pagedserve.blockmgr.block_pool import Block, FreeBlockQueue
from pagedserve.blockmgr.manager import BlockManager, BlockManagerError
from pagedserve.common.messages.blockmgr import (
    Allocate,
    Append,
    Fork,
    Free,
    SeqResult,
    Status,
    StepRequest,
    SwapIn,
    SwapOut,
    answered_seq_ids,
)

OK, NO_ROOM = Status.OK, Status.NO_ROOM


def mk(caching: bool = True, gpu: int = 9, cpu: int = 4, watermark: float = 0.0) -> BlockManager:
    return BlockManager(gpu, cpu, 4, enable_prefix_caching=caching, watermark=watermark)


def step(m: BlockManager, *ops):
    reply = m.step(StepRequest(list(ops)))
    m.check_integrity()
    return reply


def res(seq_id: int, start: int, ids: list[int], cached: int = 0, sched: int = 0) -> SeqResult:
    return SeqResult(seq_id, OK, start, ids, cached, sched)


A = list(range(100, 112))  # three full blocks
B = list(range(200, 208))  # two full blocks


def test_free_queue_is_o1_linked_list() -> None:
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])  # from the middle
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    assert q.pop_head() is blocks[0]
    q.push_head(blocks[2])
    q.push_tail(blocks[0])
    assert [b.block_id for b in q] == [2, 1, 3, 4, 0]
    with pytest.raises(AssertionError):
        q.remove(Block(9))


def test_null_block_never_handed_out_and_stats_count_usable() -> None:
    m = mk(gpu=3)
    st = m.stats()
    assert (st.num_gpu_blocks, st.num_free_gpu_blocks) == (2, 2)
    r = step(m, Allocate(1, list(range(8)), 8))
    assert r.results == [res(1, 0, [1, 2], 0, 8)]
    assert r.stats.num_free_gpu_blocks == 0 and r.stats.kv_usage == 1.0
    r = step(m, Allocate(2, [1], 1))
    assert r.results == [SeqResult(2, NO_ROOM)]


def test_prefix_cache_hit_reuses_blocks_from_next_step() -> None:
    m = mk()
    prompt = A[:10]
    r = step(m, Allocate(1, prompt, 10), Allocate(2, prompt, 10))
    # same step: block 1/2 K/V is not written yet, so no hit
    assert r.results == [res(1, 0, [1, 2, 3], 0, 10), res(2, 0, [4, 5, 6], 0, 10)]
    r = step(m, Allocate(3, prompt, 10))
    assert r.results == [res(3, 0, [1, 2, 7], 8, 2)]
    assert (r.stats.prefix_cache_queries, r.stats.prefix_cache_hits) == (6, 2)
    assert r.stats.num_shared_block_refs == 2
    # a salted request does not see unsalted blocks
    r = step(m, Allocate(4, prompt, 10, cache_salt="tenant-a"))
    assert r.results == [SeqResult(4, NO_ROOM)]  # 3 blocks needed, 1 free: nothing changed
    assert r.stats.prefix_cache_hits == 2 and r.stats.num_free_gpu_blocks == 1


def test_continued_step_does_not_commit_unwritten_blocks() -> None:
    m = mk()
    step(m, Allocate(1, A, 12))
    # a preemption round of the same step: blocks 1-3 hold no K/V yet
    r = m.step(StepRequest([Free(1), Allocate(2, A, 12)], continues_step=True))
    m.check_integrity()
    assert r.results == [None, res(2, 0, [1, 2, 3], 0, 12)]  # Free: None; no hit; freed unkeyed blocks reused first
    assert not m.gpu.cached
    r = step(m, Allocate(3, A, 12))  # next step: seq 2's blocks are cached now
    assert r.results == [res(3, 0, [1, 2, 4], 8, 4)]


def test_prefix_cache_never_covers_the_whole_prompt() -> None:
    m = mk()
    step(m, Allocate(1, B, 8))
    r = step(m, Allocate(2, B, 8))
    # 8 tokens = 2 full cached blocks, but the last token must be computed
    assert r.results == [res(2, 0, [1, 3], 4, 4)]
    # chunked: num_new_tokens caps what gets slots after the cached prefix
    r = step(m, Allocate(3, A, 3))
    assert r.results == [res(3, 0, [4], 0, 3)]


def test_chunked_prefill_hashes_like_a_whole_prompt() -> None:
    m = mk()
    prompt = A[:10]
    assert step(m, Allocate(1, prompt, 4)).results == [res(1, 0, [1], 0, 4)]
    assert step(m, Append(1, prompt[4:8])).results == [res(1, 1, [2], 0, 4)]
    assert step(m, Append(1, prompt[8:10])).results == [res(1, 2, [3], 0, 2)]
    r = step(m, Allocate(2, prompt, 10))
    assert r.results == [res(2, 0, [1, 2, 4], 8, 2)]


def test_salted_requests_share_only_within_tenant() -> None:
    m = mk()
    step(m, Allocate(1, A, 12, cache_salt="t1"))
    r = step(m, Allocate(2, A, 12, cache_salt="t1"), Allocate(3, A[:5], 5))
    assert r.results == [res(2, 0, [1, 2, 4], 8, 4), res(3, 0, [5, 6], 0, 5)]


def test_lru_eviction_tail_of_chain_first() -> None:
    m = mk()
    step(m, Allocate(1, A, 12), Allocate(2, B, 8))  # [1,2,3], [4,5]
    r = step(m, Free(1), Free(2))
    # free queue, head first: 6 7 8, then A's chain tail first (3 2 1), then B's (5 4)
    assert [b.block_id for b in m.gpu.free] == [6, 7, 8, 3, 2, 1, 5, 4]
    assert r.stats.num_free_gpu_blocks == 8
    r = step(m, Allocate(3, list(range(16)), 16))
    assert r.results == [res(3, 0, [6, 7, 8, 3], 0, 16)]  # evicts A's last block only
    r = step(m, Allocate(4, A + [999], 13))
    # A's first two blocks still hit; the two new blocks evict B's chain tail first
    assert r.results == [res(4, 0, [1, 2, 5, 4], 8, 5)]
    assert m.gpu.num_free == 0


def test_uncached_freed_blocks_are_reused_before_cached_ones() -> None:
    m = mk()
    step(m, Allocate(1, A[:6], 6))  # [1, 2]: block 1 full (cached), block 2 partial
    step(m, Free(1))
    assert [b.block_id for b in m.gpu.free] == [2, 3, 4, 5, 6, 7, 8, 1]


def test_cow_on_shared_partial_last_block() -> None:
    m = mk()
    step(m, Allocate(1, A[:6], 6))  # [1, 2], block 2 holds 2 tokens
    r = step(m, Fork(1, 2))
    assert r.results == [SeqResult(2, OK, 0, [1, 2])]
    assert r.stats.num_shared_block_refs == 2
    r = step(m, Append(1, [7]), Append(2, [8]))
    # seq 1 copies the shared last block; seq 2 then owns block 2 alone: no copy (None: unchanged)
    assert r.results == [res(1, 1, [3], 0, 1), None]
    assert r.copies == [(2, 3)]
    assert m.block_table(1) == [1, 3] and m.block_table(2) == [1, 2]
    assert r.stats.num_shared_block_refs == 1
    # fill both last blocks, then the next token needs a fresh block each
    r = step(m, Append(1, [9]), Append(2, [9]))
    assert r.results == [None, None] and r.copies == []
    r = step(m, Append(1, [1]), Append(2, [1]))
    assert r.results == [res(1, 2, [4], 0, 1), res(2, 2, [5], 0, 1)] and r.copies == []


def test_cow_plus_new_block_in_one_append() -> None:
    m = mk()
    step(m, Allocate(1, A[:6], 6), Fork(1, 2))
    r = step(m, Append(2, [1, 2, 3, 4]))  # 2 in the copied block, 2 in a new one
    assert r.results == [res(2, 1, [3, 4], 0, 4)] and r.copies == [(2, 3)]


def test_fork_of_full_last_block_needs_no_copy() -> None:
    m = mk()
    r = step(m, Allocate(1, B, 8), Fork(1, 2), Append(1, [1]), Append(2, [2]))
    assert r.results[1:] == [SeqResult(2, OK, 0, [1, 2]), res(1, 2, [3], 0, 1), res(2, 2, [4], 0, 1)]
    assert r.copies == []


def test_swap_out_in_forked_group_without_caching() -> None:
    m = mk(caching=False)
    step(m, Allocate(1, A[:6], 6))
    step(m, Fork(1, 2), Append(2, [5]))  # seq 1 [1, 2], seq 2 [1, 3] (CoW 2 -> 3)
    r = step(m, SwapOut([1, 2]))
    assert r.swap_out == [(1, 0), (2, 1), (3, 2)]  # the shared block 1 moves once
    assert r.results == [SeqResult(1, OK), SeqResult(2, OK)]  # GPU tables now empty
    assert m.block_table(1) == [0, 1] and m.block_table(2) == [0, 2]
    assert r.stats.num_free_gpu_blocks == 8 and r.stats.num_free_cpu_blocks == 1
    assert [b.block_id for b in m.gpu.free][:3] == [1, 3, 2]
    r = step(m, SwapIn([1, 2]))
    assert r.swap_in == [(0, 1), (1, 3), (2, 2)]
    assert r.results == [SeqResult(1, OK, 0, [1, 3]), SeqResult(2, OK, 0, [1, 2])]
    # the CPU blocks the swap-in reads stay held until the step's copies ran
    assert r.stats.num_shared_block_refs == 1 and r.stats.num_free_cpu_blocks == 1
    assert [b.block_id for b in m.cpu.held] == [1, 2, 0]
    assert step(m).stats.num_free_cpu_blocks == 4


def test_swap_out_after_cow_in_the_same_step_copies_from_the_source() -> None:
    m = mk(caching=False)
    step(m, Allocate(1, A[:6], 6), Fork(1, 2))  # both [1, 2], block 2 partly filled
    r = step(m, Append(1, [7]))  # CoW 2 -> 3, executed after this step's swap-outs
    assert r.copies == [(2, 3)]
    r = m.step(StepRequest([SwapOut([1])], continues_step=True))  # preemption round, same step
    # block 3 receives its content only after swap_out runs: copy from block 2
    assert r.swap_out == [(1, 0), (2, 1)]
    r = step(m, Append(2, [1]), SwapOut([2]))  # a later step: block 2 is seq 2's own now
    assert r.swap_out == [(1, 2), (2, 3)] and r.copies == []  # from block 2 itself now


def test_swap_out_gives_back_the_slots_appended_this_step() -> None:
    m = mk(caching=False)
    step(m, Allocate(1, A[:4], 4), Allocate(2, B, 8))  # seq 1 [1] full, seq 2 [2, 3]
    r = step(m, Append(1, [5]), Append(2, [6]))
    assert r.results == [res(1, 1, [4], 0, 1), res(2, 2, [5], 0, 1)]
    # preemption round of the same step: seq 1 will not run, its new slot goes back
    r = m.step(StepRequest([SwapOut([1])], continues_step=True))
    m.check_integrity()
    assert r.swap_out == [(1, 0)] and m.seqs[1].num_tokens == 4
    assert [b.block_id for b in m.gpu.free][:2] == [1, 4]
    r = step(m, SwapIn([1]), Append(1, [5]))  # the scheduler re-sends the same token later
    assert r.swap_in == [(0, 1)] and r.results[1] == res(1, 1, [4], 0, 1)


def test_swap_in_reuses_blocks_still_cached_on_gpu() -> None:
    m = mk()
    step(m, Allocate(1, A[:6], 6))
    step(m, Fork(1, 2), Append(2, [5]))  # block 1 is cached now
    r = step(m, SwapOut([1, 2]))
    assert r.swap_out == [(1, 0), (2, 1), (3, 2)]
    assert [b.block_id for b in m.gpu.free] == [3, 2, 4, 5, 6, 7, 8, 1]
    r = step(m, SwapIn([1, 2]))
    assert r.swap_in == [(1, 3), (2, 2)]  # block 1 still holds cpu block 0's content
    assert r.results == [SeqResult(1, OK, 0, [1, 3]), SeqResult(2, OK, 0, [1, 2])]
    # CPU blocks 1 and 2 are held (read by this step's swap-in); 0 was not copied
    assert [b.block_id for b in m.cpu.held] == [1, 2]
    assert [b.block_id for b in m.cpu.free] == [3, 0]
    # swapping out again reuses the CPU copy of block 1 without a copy
    r = step(m, SwapOut([1, 2]))
    assert r.swap_out == [(3, 2), (2, 1)]
    assert m.block_table(1) == [0, 2] and m.block_table(2) == [0, 1]


def test_no_room_changes_nothing_and_blocks_later_admissions() -> None:
    m = mk()
    step(m, Allocate(1, list(range(28)), 28))  # 7 of 8 blocks
    before = m.stats()
    r = step(m, Allocate(2, list(range(50, 58)), 8), Allocate(3, [1], 1), Append(1, [0]), Allocate(4, [1], 1))
    assert r.results == [SeqResult(2, NO_ROOM), SeqResult(3, NO_ROOM), res(1, 7, [8], 0, 1), SeqResult(4, NO_ROOM)]
    assert r.stats.num_seqs == before.num_seqs == 1
    r = step(m, Append(1, [1, 2, 3, 4]))  # needs a block, none left
    assert r.results == [SeqResult(1, NO_ROOM)]
    assert m.seqs[1].num_tokens == 29


def test_swap_no_room() -> None:
    m = mk(cpu=1)
    step(m, Allocate(1, A[:6], 6), Allocate(2, [1], 1))
    r = step(m, SwapOut([1]), Allocate(3, [5], 1))
    assert r.results == [SeqResult(1, NO_ROOM), SeqResult(3, NO_ROOM)] and r.swap_out == []
    r = step(m, SwapOut([2]))
    assert r.swap_out == [(3, 0)]
    r = step(m, Allocate(4, list(range(24)), 24))  # the last 6 free blocks
    assert r.results == [res(4, 0, [3, 4, 5, 6, 7, 8], 0, 24)]
    r = step(m, SwapIn([2]))
    assert r.results == [SeqResult(2, NO_ROOM)] and m.seqs[2].on_cpu


def test_watermark_applies_to_admission_not_to_append() -> None:
    m = BlockManager(101, 0, 4, watermark=0.05)  # 100 usable, keep 5 free on admission
    assert m.watermark_blocks == 5
    assert step(m, Allocate(1, list(range(380)), 380)).results[0].status is OK  # 95 blocks
    assert not m.can_allocate([1], 1)
    assert step(m, Allocate(2, [1], 1)).results == [SeqResult(2, NO_ROOM)]
    r = step(m, Append(1, list(range(20))))  # running sequences may use the reserve
    assert r.results[0].status is OK and m.gpu.num_free == 0


def test_free_of_swapped_sequence_releases_cpu_blocks() -> None:
    m = mk()
    step(m, Allocate(1, A[:6], 6), Fork(1, 2))
    step(m, SwapOut([1, 2]))
    step(m, Free(1))
    assert m.cpu.num_free == 2
    r = step(m, Free(2))
    assert r.stats.num_free_cpu_blocks == 4 and r.stats.num_seqs == 0


def test_protocol_errors_raise() -> None:
    m = mk()
    step(m, Allocate(1, [1, 2], 2))
    for ops in ([Append(9, [1])], [Free(9)], [Allocate(1, [1], 1)], [Fork(1, 1)], [SwapIn([1])],
                [SwapOut([1, 1])], [Allocate(5, [], 1)]):
        with pytest.raises(BlockManagerError):
            m.step(StepRequest(ops))
        m.check_integrity()
    step(m, SwapOut([1]))
    with pytest.raises(BlockManagerError, match="swapped out"):
        m.step(StepRequest([Append(1, [1])]))


def test_huge_token_ids_hash_without_error() -> None:
    m = mk()
    big = [2**64 - 1] * 4 + [1]
    step(m, Allocate(1, big, 5))
    assert step(m, Allocate(2, big, 5)).results == [res(2, 0, [1, 3], 4, 1)]


def test_check_integrity_detects_corruption() -> None:
    m = mk()
    step(m, Allocate(1, A, 12))
    m.gpu.blocks[2].ref_cnt += 1
    with pytest.raises(AssertionError, match="block 2 ref count 2"):
        m.check_integrity()
    m.reset()
    step(m, Allocate(1, A, 12))
    m.seqs[1].table.append(m.gpu.blocks[1])
    with pytest.raises(AssertionError, match="appears twice"):
        m.check_integrity()


def test_reset_and_everything_freed() -> None:
    m = mk()
    step(m, Allocate(1, A, 12), Fork(1, 2), Allocate(3, B, 8))
    step(m, Append(2, [1]), SwapOut([1, 2]))
    for s in (1, 2, 3):
        step(m, Free(s))
    st = m.stats()
    assert (st.num_free_gpu_blocks, st.num_free_cpu_blocks, st.num_seqs, st.num_shared_block_refs) == (8, 4, 0, 0)
    m.reset()
    assert m.stats().prefix_cache_queries == 0 and not m.gpu.cached


def test_results_pair_one_to_one_with_the_ops() -> None:
    m = mk()
    step(m, Allocate(1, A[:6], 6))
    r = step(m, Fork(1, 2), Append(1, [7]), Free(2), Append(1, [8]))
    # Fork: the child's table; the CoW append: a result; Free: None; an append into the copied block: None
    assert r.results == [SeqResult(2, OK, 0, [1, 2]), res(1, 1, [3], 0, 1), None, None]
    assert [sid for op in [Fork(1, 2), SwapOut([3, 4]), Free(5)] for sid in answered_seq_ids(op)] == [2, 3, 4, 5]


def test_admissible_blocks_are_the_free_ones_beyond_the_watermark() -> None:
    m = BlockManager(101, 0, 4, watermark=0.05)  # 100 usable, 5 kept back
    assert m.stats().num_admissible_gpu_blocks == 95
    step(m, Allocate(1, list(range(380)), 380))  # 95 blocks
    assert m.stats().num_admissible_gpu_blocks == 0


def test_skip_prefix_lookup_computes_the_whole_prompt_and_still_caches_it() -> None:
    m = mk()
    step(m, Allocate(1, A, 12))
    r = step(m, Allocate(2, A, 12, skip_prefix_lookup=True))
    assert r.results[0].num_cached_tokens == 0 and r.results[0].num_scheduled_tokens == 12
    r = step(m, Allocate(3, A, 12))
    assert r.results[0].num_cached_tokens == 8
