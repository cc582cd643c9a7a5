"""Issue 38, acceptance 3: with the same --num-gpu-blocks, the real scheduler
and block manager (in-process, over the validating simulated worker) run at
least 3x as many sequences at once with contexts of 8x the window when the
sliding layers free blocks outside their window; and the hybrid path keeps
every output exact (the simulated worker reads every group's window back)
under recompute and swap preemption, with a shared prefix cached across groups."""
from __future__ import annotations

import pytest

from pagedserve.bench.hybrid_kv import run


def test_three_times_as_many_sequences_fit_at_eight_windows() -> None:
    full = run(False)
    hybrid = run(True)
    print(f"\nfull caching: {full}\nhybrid:       {hybrid}")
    assert hybrid.pool_blocks == 6 * full.pool_blocks  # the same memory, one group's layers deep
    assert full.preemptions > 0 and full.max_full_context >= 1  # full caching is memory-bound
    assert hybrid.max_full_context >= 3 * full.max_full_context


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_hybrid_outputs_exact_under_preemption(swap: bool, prefix_caching: bool, async_scheduling: bool) -> None:
    r = run(True, num_gpu_blocks=41, num_requests=16, swap=swap, prefix_caching=prefix_caching, shared=100,
            async_scheduling=async_scheduling)
    assert r.preemptions > 0
    assert (r.prefix_cache_hits > 0) == prefix_caching


def test_a_context_that_fits_the_windows_is_never_refused() -> None:
    # 72 blocks of one group's layer: a 256-token prompt prefilled whole would take 6 x 32 = 192;
    # the scheduler cuts its chunks until its life (40 full blocks + 5 windows) fits
    r = run(True, num_gpu_blocks=13, num_requests=3, chunk=4096)
    assert r.pool_blocks == 72 and r.max_full_context >= 1


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_parallel_sampling_forks_every_group(mode: str) -> None:
    """n = 3 (fork, copy-on-write of each group's shared last block) behind a
    cached shared prefix, preempted in a small hybrid pool: the outputs of a
    dense pool that holds everything."""
    import random

    from pagedserve.blockmgr.hybrid import make_block_manager
    from pagedserve.common.config import EngineConfig
    from pagedserve.common.messages.frontend import AddRequest
    from pagedserve.common.messages.types import SamplingParams
    from pagedserve.gpuworker.sim_worker import SimWorker
    from pagedserve.scheduler.engine import EngineCore, InProcessBlockClient, InProcessWorkerClient

    outs = []
    for G, blocks in ((1, 400), (6, 25)):
        cfg = EngineConfig(block_size=8, num_gpu_blocks=blocks, max_num_seqs=64, max_num_batched_tokens=64,
                           max_model_len=200, preemption_mode=mode, swap_space=1 if mode == "swap" else 0)
        worker = SimWorker((blocks - 1) * G + 1, 8, 200 * G if mode == "swap" else 0, vocab_size=500, max_model_len=200,
                           kv_group_windows=(0, 16, 16, 16, 16, 16) if G > 1 else ())
        core = EngineCore(cfg, InProcessBlockClient(make_block_manager), InProcessWorkerClient(worker))
        rng = random.Random(1)
        shared = [rng.randrange(1, 500) for _ in range(40)]
        for i in range(10):
            p = shared + [rng.randrange(1, 500) for _ in range(rng.randrange(5, 60))]
            core.handle(AddRequest(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True, n=3, temperature=1.0,
                                                              seed=5), 0.0))
        out: dict[tuple[str, int], list[int]] = {}
        for d in core.run_until_idle():
            out[(d.request_id, d.index)] = out.get((d.request_id, d.index), []) + d.token_ids
        mgr = core.blockmgr.manager  # type: ignore[attr-defined]
        mgr.check_integrity()
        assert mgr.stats().num_free_gpu_blocks == mgr.stats().num_gpu_blocks
        assert (core.scheduler.num_preemptions > 0) == (G > 1)
        outs.append(out)
    assert len(outs[0]) == 30 and outs[0] == outs[1]
