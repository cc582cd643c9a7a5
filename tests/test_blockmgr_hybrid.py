"""Issue 38: the hybrid KV cache's block manager (blockmgr/hybrid.py), exact
block ids. Block size 4, one full group (0) and one sliding group (1) of
window 8: a query at position p needs the sliding group's blocks from
(p - 7) // 4 on."""
from __future__ import annotations

import random

import pytest

from pagedserve.blockmgr.hybrid import HybridBlockManager, make_block_manager
from pagedserve.blockmgr.manager import BlockManager
from pagedserve.blockmgr.seq_table import BlockManagerError
from pagedserve.common.messages.blockmgr import (
    Allocate,
    Append,
    Fork,
    Free,
    InitRequest,
    SeqResult,
    Status,
    StepRequest,
    SwapIn,
    SwapOut,
)


def tables(m: HybridBlockManager, seq_id: int) -> list[list[int]]:
    return [m.group_table(seq_id, g) for g in range(m.G)]


def step(m: HybridBlockManager, *ops, **kw):  # type: ignore[no-untyped-def]
    r = m.step(StepRequest(list(ops), **kw))
    m.check_integrity()
    return r


def test_dense_init_keeps_todays_manager() -> None:
    m = make_block_manager(InitRequest(16, 0, 4))
    assert type(m) is BlockManager
    h = make_block_manager(InitRequest(16, 0, 4, kv_group_windows=[0, 8]))
    assert isinstance(h, HybridBlockManager) and h.windows == [0, 8]


def test_sliding_group_frees_blocks_that_leave_the_window() -> None:
    m = HybridBlockManager(64, 0, 4, group_windows=[0, 8])
    r = step(m, Allocate(1, list(range(1, 11)), 10))
    assert r.results == [SeqResult(1, Status.OK, 0, [1, 2, 3], 0, 10, [(0, 0, [1, 2, 3]), (1, 0, [4, 5, 6])])]
    seen = []
    for t in range(11, 22):  # decode: token t is at position t - 1
        r = step(m, Append(1, [t]))
        seen.append((tables(m, 1), r.stats.num_free_gpu_blocks))
    assert seen[0] == ([[1, 2, 3], [4, 5, 6]], 57)  # position 10: window 3..10, block 0 still needed
    assert seen[1] == ([[1, 2, 3], [0, 5, 6]], 58)  # position 11: window 4..11, block 0 (0..3) freed
    assert seen[2] == ([[1, 2, 3, 7], [0, 5, 6, 8]], 56)  # a new block in each group
    assert seen[5] == ([[1, 2, 3, 7], [0, 0, 6, 8]], 57)  # position 15: block 1 (4..7) freed
    assert seen[10] == ([[1, 2, 3, 7, 9, 11], [0, 0, 0, 8, 10, 12]], 54)
    # a released block keeps its prefix key (free, cached: at the tail of the queue, evicted last)
    assert m.gpu.blocks[4].ref_cnt == 0 and m.gpu.blocks[4].block_hash is not None
    step(m, Free(1))
    assert m.stats().num_free_gpu_blocks == 63


def test_chunked_prefill_keeps_the_window_before_the_chunk() -> None:
    m = HybridBlockManager(64, 0, 4, group_windows=[0, 8])
    prompt = list(range(1, 31))
    step(m, Allocate(1, prompt, 12))
    r = step(m, Append(1, prompt[12:24]))  # the chunk's first query, at 12, needs 5..11: blocks 1, 2
    assert tables(m, 1) == [[1, 2, 3, 7, 8, 9], [0, 5, 6, 10, 11, 12]]
    assert r.results[0].group_diffs == [(0, 3, [7, 8, 9]), (1, 3, [10, 11, 12])]
    step(m, Append(1, prompt[24:]))  # first query at 24 needs 17..23: blocks 4, 5
    assert tables(m, 1) == [[1, 2, 3, 7, 8, 9, 13, 14], [0, 0, 0, 0, 11, 12, 15, 16]]


def test_prefix_hits_agree_across_groups_and_revive_released_blocks() -> None:
    m = HybridBlockManager(64, 0, 4, group_windows=[0, 8])
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks
    step(m, Allocate(1, prompt, 21))
    assert tables(m, 1) == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    r = step(m, Allocate(2, prompt[:20] + [7, 7, 7, 7], 24))
    # 5 blocks hit: all of the full group's, the sliding group's last two (position 20 needs 13..19)
    assert r.results[0].num_cached_tokens == 20 and r.results[0].num_scheduled_tokens == 4
    assert tables(m, 2) == [[1, 2, 3, 4, 5, 13], [0, 0, 0, 10, 11, 14]]
    assert (r.stats.prefix_cache_queries, r.stats.prefix_cache_hits) == (10, 5)  # counted once, not per group
    for t in range(12):  # seq 1 grows past the prompt: its sliding group lets go of blocks 7..12
        step(m, Append(1, [t]))
    assert tables(m, 1) == [[1, 2, 3, 4, 5, 6, 15, 17, 19], [0, 0, 0, 0, 0, 0, 16, 18, 20]]
    step(m, Free(2))
    r = step(m, Allocate(3, prompt[:20] + [9], 21))
    # the sliding group's blocks 10, 11 were released by both, but still cached: revived
    assert r.results[0].num_cached_tokens == 20
    assert tables(m, 3) == [[1, 2, 3, 4, 5, 21], [0, 0, 0, 10, 11, 22]]


def test_a_hit_needs_the_sliding_window_blocks() -> None:
    m = HybridBlockManager(64, 0, 4, group_windows=[0, 8])
    prompt = list(range(100, 121))
    step(m, Allocate(1, prompt, 21))
    step(m, Free(1))
    # evict the sliding group's block 11 (prompt block 4): the hit falls back to 4 blocks,
    # whose window (positions 9..15, blocks 2, 3) is still cached
    blk = m.gpu.blocks[11]
    m.gpu.free.remove(blk)
    del m.gpu.cached[blk.block_hash]  # type: ignore[arg-type]
    blk.block_hash = None
    m.gpu.free.push_head(blk)
    r = step(m, Allocate(2, prompt, 21))
    assert r.results[0].num_cached_tokens == 16
    t = tables(m, 2)
    assert t[0][:4] == [1, 2, 3, 4] and t[1][:4] == [0, 0, 9, 10]


def test_fork_cow_release_and_swap() -> None:
    m = HybridBlockManager(32, 16, 4, group_windows=[0, 8])
    step(m, Allocate(1, list(range(1, 11)), 10))
    r = step(m, Fork(1, 2))
    assert r.results[0].group_diffs == [(0, 0, [1, 2, 3]), (1, 0, [4, 5, 6])]
    r = step(m, Append(1, [11]), Append(2, [12]))
    assert r.copies == [(3, 7), (6, 8)]  # copy-on-write of the shared last block, in each group
    assert r.results[0].group_diffs == [(0, 2, [7]), (1, 2, [8])] and r.results[1] is None
    r = step(m, Append(1, [13]), Append(2, [13]))
    # both let go of block 4: shared, it is free only once both did
    assert tables(m, 1) == [[1, 2, 7], [0, 5, 8]] and tables(m, 2) == [[1, 2, 3], [0, 5, 6]]
    assert m.gpu.blocks[4].ref_cnt == 0 and m.gpu.blocks[5].ref_cnt == 2
    r = step(m, Append(1, [14]), Append(2, [14]))
    r = step(m, SwapOut([1, 2]))
    # every distinct held block moves once; released entries stay released
    assert len(r.swap_out) == 11 and all(g != 4 for g, _ in r.swap_out)
    r = step(m, SwapIn([1, 2]))
    (r1, r2) = r.results
    assert r1.group_diffs[1][2][0] == 0 and r2.group_diffs[1][2][0] == 0
    assert r1.group_diffs[1][2][1] == r2.group_diffs[1][2][1]  # still shared after the round trip
    step(m, Free(1), Free(2))
    assert m.stats().num_free_gpu_blocks == 31


def test_no_room_is_all_or_nothing_across_groups() -> None:
    m = HybridBlockManager(8, 0, 4, watermark=0.0, group_windows=[0, 16])  # 7 usable
    r = step(m, Allocate(1, list(range(1, 17)), 16))  # 4 blocks a group: 8 > 7
    assert r.results[0].status is Status.NO_ROOM and m.stats().num_free_gpu_blocks == 7
    step(m, Allocate(1, list(range(1, 13)), 12))  # 3 + 3
    r = step(m, Append(1, [1]))  # 2 new blocks, 1 free: refused, nothing taken
    assert r.results[0].status is Status.NO_ROOM and m.stats().num_free_gpu_blocks == 1
    with pytest.raises(BlockManagerError):
        step(m, Allocate(1, [1], 1))


def test_random_workload_keeps_every_invariant() -> None:
    rng = random.Random(0)
    for windows in ([0, 8], [8], [0, 8, 8, 8], [0, 0, 12]):
        m = HybridBlockManager(48, 24, 4, enable_prefix_caching=True, watermark=0.0, group_windows=windows)
        live: dict[int, int] = {}
        out: set[int] = set()
        nxt = 1
        base = [rng.randrange(50) for _ in range(12)]
        for _ in range(300):
            ops: list = []
            x = rng.random()
            if x < 0.25:
                p = base[:rng.randrange(13)] + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
                ops.append(Allocate(nxt, p, rng.randrange(1, len(p) + 1)))
            elif x < 0.35 and live:
                s = rng.choice(sorted(live))
                ops.append(Fork(s, nxt))
            elif x < 0.45 and live:
                ops.append(Free(rng.choice(sorted(live))))
            elif x < 0.55 and live:
                ops.append(SwapOut([rng.choice(sorted(live))]))
            elif x < 0.62 and out:
                ops.append(SwapIn([rng.choice(sorted(out))]))
            else:
                ops += [Append(s, [rng.randrange(50) for _ in range(rng.randrange(1, 6))]) for s in sorted(live)]
            r = step(m, *ops)
            for op, res in zip(ops, r.results):
                ok = res is None or res.status is Status.OK
                if isinstance(op, Allocate) and ok:
                    live[op.seq_id] = 1
                    nxt += 1
                elif isinstance(op, Fork):
                    live[op.child_seq_id] = 1
                    nxt += 1
                elif isinstance(op, Free):
                    live.pop(op.seq_id)
                elif isinstance(op, SwapOut) and ok:
                    live.pop(op.seq_ids[0])
                    out.add(op.seq_ids[0])
                elif isinstance(op, SwapIn) and ok:
                    out.discard(op.seq_ids[0])
                    live[op.seq_ids[0]] = 1
        for s in [*live, *out]:
            step(m, Free(s))
        assert m.stats().num_free_gpu_blocks == 47 and m.stats().num_free_cpu_blocks == 24


def test_kv_events_are_group_zeros_in_vllms_format() -> None:
    """The hybrid manager publishes exactly what a dense one publishes for the
    same requests: group 0's blocks, vLLM's hashes; other groups' keys never show."""
    from pagedserve.blockmgr.kv_events import BlockRemoved, BlockStored

    def events(m: BlockManager) -> list[tuple]:
        prompt = list(range(100, 121))
        out: list[tuple] = []
        reqs = [[Allocate(1, prompt, 21)], *[[Append(1, [t])] for t in range(12)], [Free(1)],
                [Allocate(2, prompt[:20] + [5], 21)], [Free(2)], [Allocate(3, list(range(50, 78)), 28)]]
        for ops in reqs:
            m.step(StepRequest(ops))
            m.check_integrity()
            batch = m.take_kv_events()
            for e in batch.events if batch else []:
                if isinstance(e, BlockStored):
                    out.append(("stored", tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), e.medium))
                elif isinstance(e, BlockRemoved):
                    out.append(("removed", tuple(e.block_hashes), e.medium))
                else:
                    out.append((type(e).__name__,))
        return out

    dense = events(BlockManager(10, 0, 4, kv_events=True))  # 9 usable: the last prompt evicts
    hybrid = events(HybridBlockManager(19, 0, 4, kv_events=True, group_windows=[0, 8]))  # 9 per group
    assert any(e[0] == "stored" for e in dense) and any(e[0] == "removed" for e in hybrid)
    assert [e for e in hybrid if e[0] != "removed"] == [e for e in dense if e[0] != "removed"]
    # which cached blocks a new prompt evicts depends on the other group's blocks in the queue,
    # but a removal only ever names a hash stored before
    stored = {h for e in hybrid if e[0] == "stored" for h in e[1]}
    assert all(h in stored for e in hybrid if e[0] == "removed" for h in e[1])


def test_kv_groups_of_todays_families() -> None:
    from pagedserve.gpuworker.kv_groups import kv_groups

    s, f = 512, None
    gemma = ([s] * 5 + [f]) * 3  # Gemma 3 270M: 15 sliding, 3 full
    g = kv_groups(gemma, 16, 32768)
    assert g is not None and g.group_size == 3 and g.windows == (0, 512, 512, 512, 512, 512)
    assert g.layer_group[5] == 0 and g.layer_group[11] == 0 and g.layer_group[17] == 0  # the full layers
    assert [g.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    assert g.layer_group[:5] == (1, 1, 1, 2, 2) and g.layer_slot[:5] == (0, 1, 2, 0, 1)
    oss = kv_groups([128, None] * 12, 16, 131072)  # gpt-oss: alternating
    assert oss is not None and oss.windows == (0, 128) and oss.group_size == 12
    mistral = kv_groups([4096] * 32, 16, 32768)  # every layer slides: one group
    assert mistral is not None and mistral.windows == (4096,) and mistral.group_size == 32
    assert kv_groups([None] * 4, 16, 4096) is None  # dense
    assert kv_groups([4096] * 4, 16, 4096) is None  # the window covers the context: nothing to free
    assert kv_groups(gemma, 16, 32768, disabled=True) is None
