"""``bench serving-sim`` (SIMULATED worker, real scheduler): CI-size runs of
the driver, the static batcher's gating, the slot-validated paged run under
preemption, and the CLI's table, plot and JSON line."""
from __future__ import annotations

import json
import sys

import pytest

from pagedserve.bench import serving_sim as ss
from pagedserve.common.messages import worker as wk
from pagedserve.gpuworker.sim_worker import CostModel


def test_light_load_is_the_same_for_every_memory_manager() -> None:
    """With memory to spare nothing differs but the manager, so the
    schedules, and the simulated latencies, are identical."""
    pts = {s: ss.simulate(s, "sharegpt", 0.05, 12) for s in ("paged", "orca_pow2", "orca_oracle")}
    lat = {s: p.normalized_latency for s, p in pts.items()}
    assert lat["paged"] == lat["orca_pow2"] == lat["orca_oracle"] > 0
    one = CostModel.opt13b_a100().step_time([(300, 1)], 16)
    assert one < lat["paged"] < 3 * one  # about one decode step per token, plus the prefill


def test_paged_run_under_preemption_is_slot_valid() -> None:
    """A burst beyond the pool: the real BlockManager preempts (recompute),
    and the sim worker's slot checks pass on every step; every request ends
    with exactly its output length (simulate raises otherwise)."""
    pt = ss.simulate("paged", "sharegpt", 50.0, 70, validate=True)
    assert pt.preemptions > 0 and pt.mean_batch > 15


def test_orca_batch_limits_and_ordering() -> None:
    pts = {s: ss.simulate(s, "sharegpt", 3.0, 150) for s in ("paged", "orca_max", "orca_oracle")}
    assert pts["orca_max"].mean_batch <= 7.0  # 7 x 2048 slots fit in 15,728
    assert pts["orca_max"].mean_batch < pts["orca_oracle"].mean_batch < pts["paged"].mean_batch
    assert pts["paged"].normalized_latency < pts["orca_oracle"].normalized_latency < pts["orca_max"].normalized_latency


def test_static_batcher_admits_only_when_the_batch_is_done() -> None:
    assert ss.static_batch_size(CostModel.opt13b_a100()) == 7
    admitted = 0
    batches: list[int] = []

    def on_step(clock: float, step: wk.ExecuteStep, finished: int) -> None:
        nonlocal admitted
        if step.new_seqs:
            assert finished == admitted, "a request joined a running static batch"
            admitted += len(step.new_seqs)
            batches.append(len(step.new_seqs))

    pt = ss.simulate("ft_static", "alpaca", 20.0, 60, on_step=on_step)
    assert admitted == 60 and max(batches) == 7 and len(batches) >= 60 // 7
    assert pt.mean_batch <= 7


def test_sustained_rate_interpolates_the_crossing() -> None:
    def pts(*lat: float) -> list[ss.Point]:
        return [ss.Point("paged", "sharegpt", r, 1, x, 0, 0, 0, 0, 0, 0, 0) for r, x in zip((1.0, 2.0, 3.0), lat)]

    assert ss.sustained_rate(pts(0.1, 0.3, 0.5), 0.4) == (pytest.approx(2.5), "=")
    assert ss.sustained_rate(pts(0.1, 0.2, 0.3), 0.4) == (3.0, ">=")
    assert ss.sustained_rate(pts(0.5, 0.6, 0.7), 0.4) == (1.0, "<")


def test_cli_quick_prints_table_plot_and_json(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    png = tmp_path / "fig12.png"
    assert ss.main(["--quick", "--plot", str(png)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    text = "\n".join(lines[:-1])
    assert "SIMULATED" in text and "normalized latency" in text and "paper" in text
    for label in ("ours (paged)", "Orca-Max", "Orca-Pow2", "Orca-Oracle", "FT-static"):
        assert label in text
    assert out["bench"] == "serving-sim" and out["simulated"] is True
    assert set(out["summary"]) == {"sharegpt", "alpaca"}
    share = out["summary"]["sharegpt"]
    assert share["batch"]["paper_at_rate"]["paged"] == 30.42 and share["batch"]["rate"] == 2.0
    assert set(share["batch"]["ours_at_rate"]) >= {"paged", "orca_max", "orca_pow2", "orca_oracle"}
    assert out["acceptance"]["target"] == 1.7 and isinstance(out["acceptance"]["met"], bool)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_results_still_come_and_the_plot_is_skipped(
        capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    png = tmp_path / "fig12.png"
    assert ss.main(["--quick", "--plot", str(png)]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out.strip().splitlines()[-1])
    assert out["bench"] == "serving-sim" and out["plot"] is None and out["summary"]
    assert "matplotlib is not installed" in cap.err
    assert not png.exists()
