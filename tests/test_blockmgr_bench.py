"""CI-size runs of the blockmgr benchmarks, plus their building blocks
(workload generators, buddy allocator)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pagedserve.bench import blockmgr as bench_blockmgr
from pagedserve.bench import memory as bench_memory
from pagedserve.bench import sharing as bench_sharing
from pagedserve.bench.memory import POOL_SLOTS, BuddyAllocator
from pagedserve.bench.workloads import MAX_MODEL_LEN, poisson_arrivals, sample_lengths


def last_json(capsys: pytest.CaptureFixture[str]) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) > 2, "a table is printed before the JSON line"
    return json.loads(out[-1])


@pytest.mark.parametrize("name,mean_in,mean_out", [("sharegpt", 161.31, 337.99), ("alpaca", 19.31, 58.45)])
def test_workloads_match_paper_means_and_are_seeded(name: str, mean_in: float, mean_out: float) -> None:
    reqs = sample_lengths(name, 50_000, seed=3)
    p = np.array([r.prompt_len for r in reqs])
    o = np.array([r.output_len for r in reqs])
    assert abs(p.mean() - mean_in) / mean_in < 0.03 and abs(o.mean() - mean_out) / mean_out < 0.03
    assert p.min() >= 1 and o.min() >= 1 and (p + o).max() <= MAX_MODEL_LEN
    assert np.percentile(o, 99) > 3 * mean_out  # long tail
    assert sample_lengths(name, 100, seed=3) == reqs[:100]
    assert sample_lengths(name, 100, seed=4) != reqs[:100]
    t = poisson_arrivals(2000, rate=4.0, seed=1)
    assert t == sorted(t) and abs(t[-1] / 2000 - 0.25) < 0.03


def test_buddy_allocator_splits_and_coalesces() -> None:
    b = BuddyAllocator(POOL_SLOTS)
    chunks = [b.alloc(2048) for _ in range(8)]
    # the exact-order piece first, then splits of the smallest larger piece
    assert chunks[:7] == [12288, 8192, 10240, 0, 2048, 4096, 6144] and chunks[7] is None  # Orca-Max: 7 fit
    assert b.free_slots == POOL_SLOTS - 7 * 2048
    for off in chunks[:7]:
        b.release(off, 11)
    assert b.free_slots == POOL_SLOTS and 0 in b.free[13]  # coalesced back to the 8192 piece
    b = BuddyAllocator(64)
    assert (b.alloc(5), b.alloc(16), b.alloc(8), b.alloc(1)) == (0, 16, 8, 32)
    b.release(8, 3)
    b.release(0, 3)  # 0-7 + 8-15 -> 0-15
    assert 0 in b.free[4]


def test_bench_blockmgr_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_blockmgr.main(["--running", "8,32", "--steps", "30", "--warmup", "3"]) == 0
    out = last_json(capsys)
    assert out["bench"] == "blockmgr" and [r["running"] for r in out["results"]] == [8, 32]
    for r in out["results"]:
        for mode in ("in_process", "ipc"):
            m = r[mode]
            assert 0 < m["p50_us"] <= m["p99_us"] and m["seq_steps_per_s"] > 0
        assert r["ipc"]["p50_us"] > r["in_process"]["p50_us"]  # a socket round trip costs something


def test_bench_memory_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_memory.main(["--workloads", "sharegpt", "--num-requests", "120"]) == 0
    res = last_json(capsys)["results"]["sharegpt"]
    for system, s in res.items():
        total = sum(s[k] for k in ("token_state", "reservation", "internal", "external"))
        assert abs(total - 100.0) < 1e-6, (system, total)
    assert res["orca_max"]["mean_batch"] == 7.0  # 15,728 slots hold seven 2048-slot buddy blocks
    assert res["paged"]["token_state"] > 90 > res["orca_oracle"]["token_state"]
    assert res["orca_oracle"]["token_state"] > res["orca_pow2"]["token_state"] > res["orca_max"]["token_state"]
    assert res["paged"]["reservation"] == 0


def test_bench_sharing_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_sharing.main(["--workloads", "alpaca", "--widths", "2,4", "--num-requests", "500"]) == 0
    res = last_json(capsys)["results"]["alpaca"]
    assert 0 < res["2"]["saving_pct"] < res["4"]["saving_pct"] < 50


def test_bench_memory_full_size_paged_token_state_at_least_97_percent(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3, acceptance 3, at the benchmark's own default size (about a second)."""
    assert bench_memory.main(["--workloads", "sharegpt"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]["sharegpt"]
    assert res["paged"]["token_state"] >= 97.0, res["paged"]
    for system in ("orca_max", "orca_pow2", "orca_oracle"):
        assert res[system]["token_state"] < 50.0, (system, res[system])
