"""The SIMULATED worker's cost model: its formula against a hand computation
from the paper's constants, its shape (what makes a step slower), and that
the worker reports it per step without sleeping."""
from __future__ import annotations

import dataclasses
import time

import pytest

from pagedserve.common.config import EngineConfig
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.types import SamplingParams
from pagedserve.gpuworker.sim_worker import CostModel, SimWorker

KV = 2 * 5120 * 40 * 2  # bytes of K and V per OPT-13B token (paper: 800 KB)
HBM = 1.555e12 * 0.90
FLOPS = 312e12 * 0.60


def test_opt13b_constants_are_the_papers() -> None:
    c = CostModel.opt13b_a100()
    assert c.kv_bytes_per_token == KV == 800 * 1024
    assert c.weight_bytes == 26e9
    assert c.kv_slots == 15_728  # 12 GiB / 800 KiB: the paper's "15.7K"


def test_step_time_matches_hand_computation() -> None:
    c = CostModel.opt13b_a100()
    # One decode (100 tokens in the pool) and one prefill chunk of 50 tokens after 30 cached ones.
    got = c.step_time([(100, 1), (30, 50)], block_size=16)
    mem = 26e9 + (100 + 2 * 1 + 30 + 2 * 50) * KV
    attn = 1 * (100 + 1) + 50 * (30 + 51 / 2)  # (query, key) pairs per layer
    flops = 2 * 13e9 * 51 + 4 * 40 * 5120 * attn
    assert got == pytest.approx(2e-3 + mem / HBM + flops / FLOPS, rel=1e-12)
    # Swaps cross PCIe, copy-on-write reads and writes HBM.
    extra = c.step_time([(100, 1)], 16, num_swapped_blocks=3, num_copied_blocks=2) - c.step_time([(100, 1)], 16)
    assert extra == pytest.approx(3 * 16 * KV / 25e9 + 2 * 2 * 16 * KV / HBM, rel=1e-9)
    assert c.step_time([], 16) == 0.0  # a step that only drops state runs no forward
    # A slower attention kernel (the paper's paged kernel: +20-26 %) scales only the KV reads.
    slow = dataclasses.replace(c, attention_kv_factor=1.25)
    assert slow.step_time([(100, 1)], 16) - c.step_time([(100, 1)], 16) == pytest.approx(0.25 * 101 * KV / HBM)
    # The roofline variant hides a decode batch's matmul FLOPs under the weight read.
    roof = dataclasses.replace(c, roofline=True)
    batch = [(100, 1)] * 8
    assert c.step_time(batch, 16) - roof.step_time(batch, 16) == pytest.approx(2 * 13e9 * 8 / FLOPS)
    big = [(0, 2048)]  # compute bound: the weight read hides instead
    assert c.step_time(big, 16) - roof.step_time(big, 16) == pytest.approx(26e9 / HBM)


def test_step_time_shape() -> None:
    c = CostModel.opt13b_a100()
    one = c.step_time([(500, 1)], 16)
    # A single decode reads the weights once: about 20 ms on an A100 (memory bound).
    assert 0.015 < one < 0.025
    assert c.step_time([(1500, 1)], 16) > one  # longer context, more KV read
    batch = c.step_time([(500, 1)] * 32, 16)
    assert one < batch < 2 * one  # batching amortises the weight read: the point of it all
    # A 2048-token prefill is compute bound: the FLOP term exceeds the weight read.
    prefill = c.step_time([(0, 2048)], 16)
    assert (prefill - 2e-3 - 26e9 / HBM) > 26e9 / HBM


def _step(step_id: int, new: list[tuple[wk.NewSeq, list[int]]], sched: list[tuple[int, int]]) -> wk.ExecuteStep:
    """New sequences with their blocks, sent as the scheduler does: the table as a diff in the same step."""
    return wk.ExecuteStep(step_id, [n for n, _ in new], [wk.BlockDiff(n.seq_id, 0, blocks) for n, blocks in new],
                          [wk.ScheduledSeq(s, k) for s, k in sched], [])


def test_worker_reports_modelled_time_without_sleeping() -> None:
    c = CostModel.opt13b_a100()
    w = SimWorker(16, 4, cost_model=c)
    plain = SimWorker(16, 4)
    params = SamplingParams(max_tokens=4)
    steps = [
        _step(0, [(wk.NewSeq(1, [5, 6, 7, 8, 9], 0, params, 5), [1, 2])], [(1, 5)]),
        _step(1, [], [(1, 1)]),
    ]
    t0 = time.perf_counter()
    times = [w.execute(s).forward_time_s for s in steps]
    assert time.perf_counter() - t0 < 0.01  # modelled, never slept
    assert times == [c.step_time([(0, 5)], 4), c.step_time([(5, 1)], 4)]
    assert w.simulated_time_s == pytest.approx(sum(times))
    outs = [plain.execute(s) for s in steps]
    assert [o.forward_time_s for o in outs] == [0.0, 0.0]  # no cost model: zero step time
    assert w.init().model.model_name == "simulated:opt-13b/a100-40gb"


def test_real_time_worker_sleeps_its_modelled_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGEDSERVE_SIM_TIME_SCALE=F: each step lasts F times its modelled time (end-to-end latency runs)."""
    params = SamplingParams(max_tokens=4)
    monkeypatch.setenv("PAGEDSERVE_SIM_TIME_SCALE", "2")
    w = SimWorker.from_config(EngineConfig(worker="sim", num_gpu_blocks=64, block_size=16))
    assert w.time_scale == 2.0
    prompt = list(range(1, 400))
    step = _step(0, [(wk.NewSeq(1, prompt, 0, params, len(prompt)), list(range(1, 26)))], [(1, len(prompt))])
    t0 = time.perf_counter()
    t = w.execute(step).forward_time_s
    slept = time.perf_counter() - t0
    assert t > 0.01 and 2 * t <= slept < 2 * t + 2.0  # slack for a loaded CI core, not a missed sleep
    monkeypatch.setenv("PAGEDSERVE_SIM_TIME_SCALE", "-1")
    with pytest.raises(ValueError, match="PAGEDSERVE_SIM_TIME_SCALE"):
        SimWorker.from_config(EngineConfig(worker="sim"))


def test_from_config_process_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_SIM_COST_MODEL", raising=False)
    w = SimWorker.from_config(EngineConfig(worker="sim", swap_space=1.0))
    ready = w.init()
    assert ready.num_gpu_blocks == 15_728 // 16 + 1 and ready.block_size == 16
    assert ready.num_cpu_blocks == 2**30 // (16 * KV)
    assert w.cost_model == CostModel.opt13b_a100()
    assert SimWorker.from_config(EngineConfig(worker="sim", num_gpu_blocks=40)).num_gpu_blocks == 40
    monkeypatch.setenv("PAGEDSERVE_SIM_COST_MODEL", "none")
    assert SimWorker.from_config(EngineConfig(worker="sim")).cost_model is None
    monkeypatch.setenv("PAGEDSERVE_SIM_COST_MODEL", "h100")
    with pytest.raises(ValueError, match="PAGEDSERVE_SIM_COST_MODEL"):
        SimWorker.from_config(EngineConfig(worker="sim"))


def test_slot_pool_catches_a_shared_block_and_follows_swaps() -> None:
    params = SamplingParams(max_tokens=4)
    w = SimWorker(8, 4, num_cpu_blocks=4)
    # Two sequences wrongly given the same block: the second write clobbers the first.
    w.execute(_step(0, [(wk.NewSeq(1, [1, 2, 3], 0, params, 3), [1])], [(1, 3)]))
    with pytest.raises(Exception, match="reads token"):
        w.execute(_step(1, [(wk.NewSeq(2, [4, 5, 6], 0, params, 3), [1])], [(2, 3), (1, 1)]))
    # A swap out and back in to another block keeps the content readable.
    w = SimWorker(8, 4, num_cpu_blocks=4)
    w.execute(_step(0, [(wk.NewSeq(1, [1, 2, 3], 0, params, 3), [1])], [(1, 3)]))
    w.execute(wk.ExecuteStep(1, [], [], [], [], swap_out=[(1, 2)]))
    w.execute(wk.ExecuteStep(2, [], [wk.BlockDiff(1, 0, [5])], [], [], swap_in=[(2, 5)]))
    w.pool.gpu[1 * 4:2 * 4] = w.pool.gpu[0:4]  # the old block is reused by someone else
    assert w.execute(_step(3, [], [(1, 1)])).sampled  # reads back through block 5


def test_a_new_seq_the_worker_holds_is_refused_unless_dropped_first() -> None:
    """The step application both workers share (gpuworker/seq_state.py): the
    scheduler drops a sequence (finished) before it re-sends it."""
    params = SamplingParams(max_tokens=4)
    w = SimWorker(8, 4)
    w.execute(_step(0, [(wk.NewSeq(1, [1, 2, 3], 0, params, 3), [1])], [(1, 3)]))
    with pytest.raises(ValueError, match="sent as new while the worker holds it"):
        w.execute(_step(1, [(wk.NewSeq(1, [1, 2, 3], 0, params, 3), [1])], [(1, 3)]))
    again = wk.ExecuteStep(2, [wk.NewSeq(1, [1, 2, 3], 0, params, 3)], [wk.BlockDiff(1, 0, [2])],
                           [wk.ScheduledSeq(1, 3)], finished=[1])  # recompute: drop, re-send, blocks as a diff
    assert [t.seq_id for t in w.execute(again).sampled] == [1]
