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


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_hybrid_outputs_exact_under_preemption(swap: bool, prefix_caching: bool) -> None:
    r = run(True, num_gpu_blocks=41, num_requests=16, swap=swap, prefix_caching=prefix_caching, shared=100)
    assert r.preemptions > 0
    assert (r.prefix_cache_hits > 0) == prefix_caching


def test_a_context_that_fits_the_windows_is_never_refused() -> None:
    # 72 blocks of one group's layer: a 256-token prompt prefilled whole would take 6 x 32 = 192;
    # the scheduler cuts its chunks until its life (40 full blocks + 5 windows) fits
    r = run(True, num_gpu_blocks=13, num_requests=3, chunk=4096)
    assert r.pool_blocks == 72 and r.max_full_context >= 1
