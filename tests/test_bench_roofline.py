"""The roofline bound of benchmarks/roofline.py: the schedule's arithmetic, by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.roofline import bound_seconds, model_shape


def test_each_step_takes_the_larger_of_bytes_and_flops() -> None:
    shape = {"params": 10 ** 9, "kv_bytes": 1000}
    rates = {"read_gb_s": 100.0, "peak_gflop_s": 1000.0}
    b = bound_seconds([(10, 3), (5, 1)], shape, rates)
    assert b["prefill_s"] == pytest.approx(0.03)  # 15 prompt tokens x 2 GFLOP at 1 TFLOP/s > 2 GB at 100 GB/s
    # two decode steps, only the first request runs: weights + its 11 then 12 tokens of KV, read-bound
    assert b["decode_s"] == pytest.approx((2e9 + 11_000) / 1e11 + (2e9 + 12_000) / 1e11)
    assert b["decode_steps"] == 2 and b["total_s"] == pytest.approx(b["prefill_s"] + b["decode_s"])
    busy = bound_seconds([(10, 3)] * 200, shape, rates)  # 200 rows: compute-bound steps
    assert busy["decode_s"] == pytest.approx(2 * 2e9 * 200 / 1e12)


def test_model_shape_counts_llama_1b(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192, "vocab_size": 49152,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 8192}))
    s = model_shape(str(tmp_path))
    assert s["params"] == 16 * (2048 * 3072 + 2048 * 2048 + 3 * 2048 * 8192) + 49152 * 2048
    assert s["kv_bytes"] == 16 * 2 * 512 * 2


def test_the_probe_rate_leaves_out_samples_a_stop_cut_through() -> None:
    """A sample the bench stopped midway (its time holds the others' slices) is not a read rate."""
    from benchmarks.peer_slices import ReadProbe

    probe = ReadProbe.__new__(ReadProbe)
    probe.samples = [(9.0, 1, 0.0)] + [(0.06, 2_000_000_000, 0.0)] * 4 + [(2.06, 2_000_000_000, 0.0)]
    assert probe.rate_since(1) == pytest.approx(2 / 0.06)  # the 2.06 s sample left out, the first before i
    probe.samples.append((0.04, 2_000_000_000, 0.0))
    assert probe.rate_since(1) == pytest.approx(10 / 0.28)
    with pytest.raises(RuntimeError, match="no sample"):  # a bound at 0 GB/s would divide by zero
        probe.rate_since(len(probe.samples))


def test_a_probe_that_cannot_sample_is_an_error_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No panels (no compiler): the probe says why and ends; the bench stops there, not 300 s later."""
    import time

    from benchmarks.peer_slices import ReadProbe

    monkeypatch.setenv("CXX", "/nonexistent/g++")  # the child's kernel build finds no compiler
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="took no sample"):
        ReadProbe("smol")
    assert time.perf_counter() - t0 < 120
    with pytest.raises(RuntimeError, match="did not start"):
        ReadProbe("nope")  # the probe's own usage error: no first line
