"""The contiguous-reservation manager of the Orca baselines: exact offsets and
block ids from the buddy allocator, FCFS no_room, appends that never fail,
and the real scheduler running unchanged on top of it with the SIMULATED
worker's slot-level checks on."""
from __future__ import annotations

import random

import pytest
from test_scheduler import RecordingWorker

from pagedserve.bench.contiguous import ContiguousBlockManager, ContiguousError
from pagedserve.bench.memory import POOL_SLOTS, reserve
from pagedserve.bench.workloads import RequestLen, sharegpt_like
from pagedserve.common.config import EngineConfig
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages.frontend import AddRequest
from pagedserve.common.messages.types import SamplingParams
from pagedserve.gpuworker.sim_worker import SimWorker, expected_output
from pagedserve.scheduler.engine import EngineCore, InProcessBlockClient

BS = 16
PAPER_BLOCKS = POOL_SLOTS // BS + 1  # 15,728 slots + the null block


def make(policy: str, lens: dict[int, RequestLen], num_blocks: int = PAPER_BLOCKS, bs: int = BS,
         max_len: int = 2048) -> ContiguousBlockManager:
    return ContiguousBlockManager(num_blocks, bs, policy, lambda toks: lens[toks[0]], max_len)


def alloc(i: int, n: int, k: int | None = None) -> bm.Allocate:
    return bm.Allocate(i, [i] + [7] * (n - 1), n if k is None else k)


def test_orca_max_fits_seven_and_later_admissions_wait() -> None:
    lens = {i: RequestLen(10, 10) for i in range(10)}
    m = make("orca_max", lens)
    rep = m.step(bm.StepRequest([alloc(i, 10) for i in range(9)]))
    ok = [r for r in rep.results if r.status is bm.Status.OK]
    assert len(ok) == 7 and all(r.status is bm.Status.NO_ROOM for r in rep.results[7:])
    # Buddy placement (as in bench memory): the 2048-slot piece first, then splits of the larger ones.
    assert [r.block_ids[0] - 1 for r in ok] == [o // BS for o in (12288, 8192, 10240, 0, 2048, 4096, 6144)]
    assert all(r.block_ids == list(range(r.block_ids[0], r.block_ids[0] + 128)) for r in ok)
    assert ok[0].num_scheduled_tokens == 10 and ok[0].num_cached_tokens == 0
    assert rep.stats.num_free_gpu_blocks == (POOL_SLOTS - 7 * 2048) // BS
    m.check_integrity()
    # Even a tiny admission waits behind a refused one in the same step (FCFS).
    m2 = make("orca_oracle", {0: RequestLen(1000, 1000), 1: RequestLen(1000, 1000), 2: RequestLen(2, 2)},
              num_blocks=3000 // BS + 1)  # 2992 slots: 2048 + 512 + ...
    rep = m2.step(bm.StepRequest([alloc(0, 1000), alloc(1, 1000), alloc(2, 2)]))
    assert [r.status for r in rep.results] == [bm.Status.OK, bm.Status.NO_ROOM, bm.Status.NO_ROOM]


@pytest.mark.parametrize("policy", ["orca_max", "orca_pow2", "orca_oracle"])
def test_reservation_sizes_match_bench_memory(policy: str) -> None:
    reqs = sharegpt_like(300, seed=5) + [RequestLen(3, 4), RequestLen(1000, 1048)]
    m = make(policy, {})
    for r in reqs:
        assert m.reservation_size(r) == max(BS, reserve(policy, r))


def test_appends_fill_the_reservation_and_never_fail() -> None:
    lens = {1: RequestLen(100, 200)}  # oracle: 300 slots, on a 512-slot buddy block
    m = make("orca_oracle", lens)
    rep = m.step(bm.StepRequest([alloc(1, 100, k=64)]))  # a 64-token prefill chunk
    (r,) = rep.results
    assert r.num_scheduled_tokens == 64 and len(r.block_ids) == 19  # ceil(300 / 16): the whole reservation
    assert m.seqs[1].order == 9
    rep = m.step(bm.StepRequest([bm.Append(1, [7] * 36)] + [bm.Append(1, [3])] * 199))
    assert rep.results == [None] * 200  # the table never changes
    assert m.seqs[1].num_tokens == 299  # prompt + output - 1: the last sampled token is never stored
    m.check_integrity()
    with pytest.raises(ContiguousError, match="outgrow"):
        m.step(bm.StepRequest([bm.Append(1, [1, 2])]))
    m.step(bm.StepRequest([bm.Free(1)]))
    assert m.stats().num_free_gpu_blocks == m.stats().num_gpu_blocks == POOL_SLOTS // BS
    assert m.buddy.free == make("orca_oracle", lens).buddy.free  # coalesced back
    with pytest.raises(ContiguousError):
        m.step(bm.StepRequest([bm.Fork(1, 2)]))


def test_random_trace_keeps_integrity() -> None:
    rng = random.Random(0)
    reqs = sharegpt_like(400, seed=1)
    lens = dict(enumerate(reqs))
    m = make("orca_pow2", lens)
    live: dict[int, int] = {}  # seq -> tokens still to append
    nxt = 0
    for _ in range(300):
        ops: list[bm.Op] = []
        for s in [s for s, left in live.items() if left == 0]:
            ops.append(bm.Free(s))
            del live[s]
        for s in live:
            k = min(live[s], rng.randint(1, 24))
            ops.append(bm.Append(s, [1] * k))
            live[s] -= k
        while nxt < len(reqs) and rng.random() < 0.5:
            ops.append(alloc(nxt, reqs[nxt].prompt_len))
            nxt += 1
        rep = m.step(bm.StepRequest(ops))
        refused = False
        for r in rep.results:
            if r is None:  # an Append or Free: the table never changes
                continue
            if r.status is bm.Status.OK:
                assert not refused
                live[r.seq_id] = reqs[r.seq_id].output_len - 1
            else:
                refused = True
        if refused:  # retry later, FCFS
            nxt = min(r.seq_id for r in rep.results if r is not None and r.status is bm.Status.NO_ROOM)
        m.check_integrity()
        u = m.slot_usage()
        assert u["tokens"] + u["reserved"] + u["rounding"] + u["free"] == POOL_SLOTS
    assert nxt > 100 and m.num_no_room > 0


@pytest.mark.parametrize("policy", ["orca_max", "orca_pow2", "orca_oracle"])
def test_real_scheduler_runs_unchanged_on_contiguous(policy: str) -> None:
    """Same Scheduler, small pool, slot-level validation in the sim worker:
    every request completes token-identical to an unconstrained run, with
    no preemption, and concurrent reservations never exceed the pool."""
    bs, num_blocks, max_len = 4, 65, 128  # 256 slots
    rng = random.Random(7)
    reqs = [RequestLen(rng.randint(2, 40), rng.randint(1, 60)) for _ in range(24)]
    lens = dict(enumerate(reqs))
    holder: dict[str, ContiguousBlockManager] = {}

    def factory(init: bm.InitRequest) -> ContiguousBlockManager:
        holder["m"] = make(policy, lens, init.num_gpu_blocks, init.block_size, max_len)
        return holder["m"]

    vocab = 500
    worker = RecordingWorker(SimWorker(num_blocks, bs, 0, vocab, max_model_len=max_len, validate=True))
    cfg = EngineConfig(block_size=8, max_num_seqs=64, max_num_batched_tokens=32, enable_prefix_caching=False)
    core = EngineCore(cfg, InProcessBlockClient(factory), worker)
    prompts = {i: [i] + [rng.randrange(1, vocab) for _ in range(r.prompt_len - 1)] for i, r in lens.items()}
    for i, r in lens.items():
        core.handle(AddRequest(str(i), prompts[i], SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                                  ignore_eos=True), float(i)))
    m = holder["m"]
    out: dict[str, list[int]] = {}
    max_live = 0
    while core.has_work():
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
        m.check_integrity()
        max_live = max(max_live, len(m.seqs))
    for i, r in lens.items():
        assert out[str(i)] == expected_output(prompts[i], r.output_len, vocab)
    assert core.scheduler.num_preemptions == 0
    assert m.num_no_room > 0  # the pool was the limit
    assert max(len(s.scheduled) for s in worker.steps) == max_live
    if policy == "orca_max":
        assert max_live == 2  # 256 slots / 128
    core.step()
    assert not m.seqs and m.stats().num_free_gpu_blocks == 64
