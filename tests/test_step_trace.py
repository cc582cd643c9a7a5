"""The worker's step trace (PAGEDSERVE_STEP_TRACE=1): one line per step with
its batch, wall and CPU time; idle gaps between steps are still counted."""
from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest
from models import make_tiny_model

from pagedserve.common.config import EngineConfig
from pagedserve.common.messages.types import SamplingParams
from pagedserve.common.messages.worker import BlockDiff, ExecuteStep, NewSeq, ScheduledSeq
from pagedserve.gpuworker.model_runner import ModelRunner
from pagedserve.gpuworker.step_gaps import StepGaps


class Clock:
    def __init__(self, *ticks: float) -> None:
        self.ticks = list(ticks)

    def __call__(self) -> float:
        return self.ticks.pop(0)


def test_trace_lines_and_gaps_from_the_clocks() -> None:
    out = io.StringIO()
    # wall: step 1 from 10.0 to 10.25, step 2 from 10.27 to 10.30; cpu: 0.4 s, then 0.05 s
    counts = iter([(5, 7, 100), (9, 8, 100), (9, 8, 100), (9, 20, 164)])
    g = StepGaps(trace=out, clock=Clock(10.0, 10.25, 10.27, 10.30), cpu_clock=Clock(1.0, 1.4, 2.0, 2.05),
                 counts=lambda: next(counts), epoch=Clock(1796533611.3246, 1796533611.5))
    g.begin()
    g.end(3, 66)
    g.begin()
    g.end(4, 4)
    assert out.getvalue().splitlines() == [
        "pagedserve gpuworker: step of 3 seqs, 66 tokens: wall 250.0 ms, cpu 400.0 ms; preempted 4, waited 1, faults 0; "
        "ended 1796533611.325",
        "pagedserve gpuworker: step of 4 seqs, 4 tokens: wall 30.0 ms, cpu 50.0 ms; preempted 0, waited 12, faults 64; "
        "ended 1796533611.500",
    ]
    assert list(g.gaps) == pytest.approx([0.02])
    assert g.busy_s == pytest.approx(0.28)


def test_no_trace_reads_no_cpu_clock() -> None:
    def never() -> float:
        raise AssertionError("the CPU clock is read only when tracing")

    def no_counts() -> tuple[int, int, int]:
        raise AssertionError("getrusage is called only when tracing")

    g = StepGaps(clock=Clock(1.0, 2.0), cpu_clock=never, counts=no_counts)
    g.begin()
    g.end(1, 1)
    assert g.busy_s == 1.0


@pytest.mark.parametrize("flag", ["1", "0"])
def test_worker_traces_each_step_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str], flag: str) -> None:
    monkeypatch.setenv("PAGEDSERVE_STEP_TRACE", flag)
    runner = ModelRunner(EngineConfig(model=make_tiny_model(tmp_path), num_gpu_blocks=16))
    runner.init()
    capsys.readouterr()
    params = SamplingParams(temperature=0.0, max_tokens=4)
    new = [NewSeq(0, list(range(5, 25)), 0, params, 20), NewSeq(1, list(range(7, 12)), 0, params, 5)]
    runner.execute(ExecuteStep(0, new, [BlockDiff(0, 0, [3, 4]), BlockDiff(1, 0, [9])],
                               [ScheduledSeq(0, 20), ScheduledSeq(1, 5)], []))
    runner.execute(ExecuteStep(1, [], [], [ScheduledSeq(0, 1), ScheduledSeq(1, 1)], []))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("pagedserve gpuworker: step")]
    if flag == "0":
        assert lines == []
        return
    pattern = (r"pagedserve gpuworker: step of 2 seqs, (\d+) tokens: wall ([\d.]+) ms, cpu ([\d.]+) ms; "
               r"preempted \d+, waited \d+, faults \d+; ended ([\d.]+)")
    matches = [re.fullmatch(pattern, ln) for ln in lines]
    assert all(matches) and [int(m[1]) for m in matches if m] == [25, 2], lines
    assert all(float(m[2]) > 0 for m in matches if m)
    ends = [float(m[4]) for m in matches if m]
    assert ends == sorted(ends) and abs(ends[-1] - time.time()) < 60, ends
