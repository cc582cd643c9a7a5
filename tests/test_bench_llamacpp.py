"""The llama.cpp benchmark's workloads and verdicts (issue 40, acceptance 2, 3 and 6): the
bars are computed from the medians of the run, never written in."""
from __future__ import annotations

from benchmarks import llamacpp


def test_scenarios_have_the_issue_shapes() -> None:
    single, eight, many = (llamacpp.workload(s) for s in ("single", "streams8", "many"))
    assert [(len(p), o) for p, o in single] == [(64, 256)]
    assert [(len(p), o) for p, o in eight] == [(64, 256)] * 8
    assert len({tuple(p) for p, _ in eight}) == 8  # eight different prompts: no prefix cache between them
    assert len(many) == 64 and all(1 <= len(p) <= 1024 and len(p) + o <= 2047 for p, o in many)


def test_verdicts_follow_the_medians() -> None:
    entry = {"ratio_vs_llama_cpp": {"pagedserve": 1.2, "pagedserve-bf16": 1.1}, "ratio_quant_vs_bf16": 0.97}
    v = llamacpp.verdict("single", entry)
    assert v["vs_llama_cpp"] == {"ratio": 1.2, "bar": 1.0, "pass": True}
    assert v["vs_own_bf16"] == {"ratio": 0.97, "bar": 1.0, "pass": False}
    assert llamacpp.verdict("streams8", {"ratio_quant_vs_bf16": 1.4}) == {
        "vs_own_bf16": {"ratio": 1.4, "bar": 1.0, "pass": True}}
    many = llamacpp.verdict("many", {"ratio_vs_llama_cpp": {"pagedserve": 2.9}, "ratio_quant_vs_bf16": 1.3})
    assert many["vs_llama_cpp"]["pass"] is False and many["vs_own_bf16"]["pass"] is True
    assert llamacpp.verdict("streams8", {})["vs_own_bf16"] is None  # not measured is not passed
