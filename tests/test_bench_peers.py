"""Issue 10: `bench peers` runs pagedserve and transformers on one seeded
workload in one run, checks greedy agreement, and writes its chart. CI has
no vLLM venv: the vLLM engine is then skipped, and the result says so."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from models import make_tiny_model

from benchmarks import peers
from benchmarks.peer_engines import RunResult


def _result(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("BENCH_PEERS_JSON ")]
    assert len(lines) == 1, out
    return json.loads(lines[0].split(" ", 1)[1])


def test_bench_peers_ci_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_model(tmp_path, "llama", seed=0)
    missing = tmp_path / "no-peers-venv" / "bin" / "python"
    out_dir = tmp_path / "out"
    assert peers.main(["--model", model, "--engines", "pagedserve,pagedserve-async,hf,vllm", "--requests", "6",
                       "--max-output", "12",
                       "--repeats", "3", "--workload", "alpaca,sharegpt", "--out", str(out_dir),
                       "--peers-python", str(missing), "--serve-arg=--max-num-seqs=8",
                       "--serve-arg=--kv-cache-memory=16MiB"]) == 0
    text = capsys.readouterr().out
    res = _result(text)
    assert res["bench"] == "peers" and res["engines"] == ["pagedserve", "pagedserve-async", "hf"]
    # The worker's idle time between steps, async and synchronous scheduling.
    assert set(res["worker_idle_between_steps"]) == {"pagedserve", "pagedserve-async"}
    assert all("p50" in g for g in res["worker_idle_between_steps"].values())
    assert "vllm" in res["skipped"] and "vLLM skipped" in text and "vLLM CPU" not in text
    assert "--max-num-seqs=8" in res["serve_args"]
    for w in ("alpaca", "sharegpt"):
        s = res["workloads"][w]
        assert s["requests"] == 6 and 6 <= s["output_tokens"] <= 6 * 12
        for e in ("pagedserve", "pagedserve-async", "hf"):
            assert len(s["engines"][e]["tok_s"]) == 3 and min(s["engines"][e]["tok_s"]) > 0
            assert s["output_tokens_by_engine"][e] == s["output_tokens"]
        ratio = s["median_ratio"]["pagedserve/hf"]
        assert ratio > 0 and set(s["median_ratio"]) == {"pagedserve/hf", "pagedserve/pagedserve-async"}
        # The tiny model's logits are well separated: greedy ids must agree exactly
        # (with transformers, and between async and synchronous scheduling:
        # the default on CPU is synchronous).
        for e in ("hf", "pagedserve-async"):
            assert s["greedy_match"][e] == {"identical": 6, "of": 6, "first_divergence": []}
        assert s["unstable_runs"] == {"pagedserve": 0, "pagedserve-async": 0, "hf": 0}
    png = out_dir / "bench-peers.png"
    assert res["chart"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out_dir / "bench-peers.json").read_text())["workloads"].keys() == {"alpaca", "sharegpt"}
    # Each pagedserve server's log is kept, every timed run marked where it began.
    for e in ("pagedserve", "pagedserve-async"):
        log = (out_dir / f"{e}-server.log").read_text()
        marks = [ln for ln in log.splitlines() if ln.startswith("=== bench peers: run ")]
        assert [m.split(": ", 2)[2] for m in marks] == ["alpaca", "sharegpt"] * 3, marks
        assert "serving" in log.lower()


def test_bench_peers_text_path_detokenizes_in_every_engine(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """--text (issue 23, acceptance 1's text path): pagedserve's frontend and
    transformers' batch_decode each detokenize in the timed run, and the texts of
    requests whose ids agree are identical."""
    model = make_tiny_model(tmp_path, "llama", seed=0)
    assert peers.main(["--model", model, "--engines", "pagedserve,hf,vllm", "--requests", "4", "--max-output", "10",
                       "--repeats", "1", "--workload", "alpaca", "--out", str(tmp_path / "out"), "--text",
                       "--peers-python", str(tmp_path / "none" / "python"),
                       "--serve-arg=--kv-cache-memory=16MiB"]) == 0
    text = capsys.readouterr().out
    res = _result(text)
    s = res["workloads"]["alpaca"]
    assert res["text"] is True and "text (detokenized)" in text
    assert s["greedy_match"]["hf"]["identical"] == 4
    assert s["text_match"] == {"hf": {"identical": 4, "of": 4}}
    assert min(s["text_chars_by_engine"].values()) > 0, s["text_chars_by_engine"]


def test_text_agreement_compares_only_requests_whose_ids_agree() -> None:
    got = peers.text_agreement([[1], [2], [3]], ["a", "b", "c"], [[1], [9], [3]], ["a", "x", "C"])
    assert got == {"identical": 1, "of": 2}
    # An incomplete last character: held back by one engine, U+FFFD in the other.
    got = peers.text_agreement([[1], [2]], ["a\ufffdb", "c"], [[1], [2]], ["a\ufffdb\ufffd\ufffd", "\ufffdc"])
    assert got == {"identical": 1, "of": 2}


def test_greedy_agreement_reports_first_divergence() -> None:
    ref = [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert peers.greedy_agreement(ref, [[1, 2, 3], [4, 9, 6], [7, 8]]) == \
        {"identical": 2, "of": 3, "first_divergence": [1]}


def test_workload_is_identical_for_every_engine_and_capped() -> None:
    a = peers.build_workload("sharegpt", 64, 0, 49152, 2048, None)
    assert a == peers.build_workload("sharegpt", 64, 0, 49152, 2048, None)
    assert 5000 <= sum(o for _, o in a) <= 6500  # ShareGPT-like x0.25
    b = peers.build_workload("alpaca", 64, 0, 49152, 2048, 8)
    assert max(o for _, o in b) == 8 and all(max(p) < 49152 for p, _ in b)
    assert all(len(p) + o < 100 for p, o in peers.build_workload("sharegpt", 64, 0, 500, 100, None))


def test_rounds_rotate_the_engine_order() -> None:
    names = ["pagedserve", "hf", "vllm"]
    firsts = {peers.rotated(names, r)[0] for r in range(3)}
    assert firsts == set(names) and sorted(peers.rotated(names, 1)) == sorted(names)


def test_serving_peer_ratios_and_missing_vllm_venv(tmp_path: Path) -> None:
    from benchmarks import serving
    from benchmarks.vllm_server import start_vllm_serve

    q = {"mean": 1.0, "p50": 10.0, "p90": 1.0, "p99": 40.0}
    ours = {k: dict(q) for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")}
    peer = {k: {**q, "p50": 20.0, "p99": 20.0} for k in ours}
    peer["e2e_ms"]["p99"] = None
    r = serving.ratios(ours, peer)
    assert r["ttft_ms_p50"] == 0.5 and r["itl_ms_p99"] == 2.0 and r["e2e_ms_p99"] is None
    with pytest.raises(FileNotFoundError, match="setup-peers"):
        start_vllm_serve("/nonexistent", "m", 64, 4, python=tmp_path / "bin" / "python")


def test_benchmarks_serving_compares_over_http_only() -> None:
    """`python -m benchmarks serving` is `pagedserve bench serving` plus the vLLM step, which needs
    the HTTP API: without --http or --launch it stops before any load is sent."""
    from benchmarks import serving

    with pytest.raises(SystemExit, match="over HTTP"):
        serving.main(["--num-requests", "1"])


def test_python_m_benchmarks_lists_and_runs_by_name() -> None:
    """From the repository root, as the docs run it: the harnesses by name, helpers refused."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    run = lambda *a: subprocess.run([sys.executable, "-m", "benchmarks", *a], cwd=root, capture_output=True,  # noqa: E731
                                    text=True, timeout=120)
    listing = run("--help")
    assert listing.returncode == 0 and "peers" in listing.stdout and "vllm-diff" in listing.stdout, listing
    assert "peer-engines" not in listing.stdout and "vllm-server" not in listing.stdout
    helper = run("vllm_server")
    assert helper.returncode == 2 and "no such benchmark" in helper.stderr, helper
    peers_help = run("peers", "--help")
    assert peers_help.returncode == 0 and "python -m benchmarks peers" in peers_help.stdout, peers_help


def test_chart_without_matplotlib_is_skipped_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert peers._chart(tmp_path / "c.png", {}) is None
    assert "matplotlib is not installed" in capsys.readouterr().out and not (tmp_path / "c.png").exists()


def test_set_paused_stops_and_continues_a_whole_process_tree() -> None:
    import subprocess
    import sys
    import time

    from benchmarks.peer_engines import proc_stat, process_tree, set_paused

    # A parent with a child in its own process group, as serve's components are.
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
            "process_group=0); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code])

    class Eng:
        def pids(self) -> list[int]:
            return [parent.pid]

    def states() -> list[str]:
        return [proc_stat(pid)[0] for pid in process_tree(parent.pid)]

    try:
        deadline = time.monotonic() + 10
        while len(process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(process_tree(parent.pid)) == 2
        set_paused(Eng(), True)
        time.sleep(0.2)
        assert states() == ["T", "T"]  # stopped, the child too
        set_paused(Eng(), False)
        time.sleep(0.2)
        assert "T" not in states()
    finally:
        for pid in reversed(process_tree(parent.pid)):
            subprocess.run(["kill", "-9", str(pid)])
        parent.wait()


def test_the_long_prompt_workload_shares_a_system_prompt() -> None:
    from benchmarks.peers import LONG_SYSTEM_TOKENS, build_workload

    work = build_workload("long", 32, 0, 1000, 4096, None)
    assert len(work) == 32 and {o for _, o in work} == {128}
    assert all(1500 <= len(p) <= 2000 for p, _ in work)
    system = work[0][0][:LONG_SYSTEM_TOKENS]
    assert all(p[:LONG_SYSTEM_TOKENS] == system for p, _ in work)
    assert len({tuple(p[LONG_SYSTEM_TOKENS:LONG_SYSTEM_TOKENS + 8]) for p, _ in work}) == 32  # own parts differ
    assert build_workload("long", 32, 0, 1000, 4096, None) == work  # seeded


def test_the_fixed_workload_gives_every_request_one_shape() -> None:
    """Every decode step of a fixed run has --requests rows: 64 prompt tokens each (distinct
    prompts, seeded) and --max-output output tokens (128 without it)."""
    from benchmarks.peers import FIXED_PROMPT_TOKENS, build_workload

    work = build_workload("fixed", 8, 0, 1000, 4096, 192)
    assert len(work) == 8 and {o for _, o in work} == {192} and {len(p) for p, _ in work} == {FIXED_PROMPT_TOKENS}
    assert len({tuple(p) for p, _ in work}) == 8
    assert {o for _, o in build_workload("fixed", 2, 0, 1000, 4096, None)} == {128}
    assert build_workload("fixed", 8, 0, 1000, 4096, 192) == work


def _check_roofline(s: dict, model: str, work: list, names: list[str]) -> None:
    """--roofline: each engine's rounds' probe rates, the schedule's least time at each, and its share of it."""
    from benchmarks.roofline import bound_seconds, model_shape

    lengths = [(len(ids), o) for ids, o in work]
    roof = s["roofline"]
    for e in names:
        rounds, secs = roof["rounds"][e], s["engines"][e]["seconds"]
        assert len(rounds) == len(secs) == 2 and all(1 < b["read_gb_s"] < 1000 for b in rounds), roof
        for b in rounds:
            assert b["bound_s"] == pytest.approx(bound_seconds(lengths, model_shape(model), b)["total_s"])
        shares = [b["bound_s"] / t for b, t in zip(rounds, secs)]
        assert roof["share_of_bound"][e] == pytest.approx(shares)
        assert roof["lead_at_the_bound"][e] == pytest.approx(sum(1 / x for x in shares) / 2)  # median of 2


def test_whole_rounds_with_the_read_probe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--roofline without --slice: the probe runs alone around each engine's run, and each run
    gets the least time at the rate read then."""
    model = make_tiny_model(tmp_path, "llama", seed=0)
    assert peers.main(["--model", model, "--engines", "pagedserve", "--requests", "2", "--max-output", "8",
                       "--repeats", "2", "--workload", "fixed", "--roofline", "smol", "--out", str(tmp_path / "out"),
                       "--serve-arg=--kv-cache-memory=16MiB"]) == 0
    out = capsys.readouterr()
    _check_roofline(_result(out.out)["workloads"]["fixed"], model, peers.build_workload("fixed", 2, 0, 1000, 4096, 8),
                    ["pagedserve"])
    assert out.err.count("fixed pagedserve: probe read ") == 2, out.err


def test_sliced_rounds_time_each_engine_by_its_own_slices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--slice: both engines run each round at once, one at a time on the machine; each
    engine's time is its slices' sum, under its wall clock (the other's slices fall in it)."""
    import os
    import re

    model = make_tiny_model(tmp_path, "llama", seed=0)
    assert peers.main(["--model", model, "--engines", "pagedserve,pagedserve-sync", "--requests", "4",
                       "--max-output", "150", "--repeats", "2", "--workload", "fixed", "--slice", "0.05",
                       "--fresh", "--roofline", "smol", "--out", str(tmp_path / "out"),
                       "--serve-arg=--kv-cache-memory=16MiB"]) == 0
    assert "PAGEDSERVE_WORKER_ADAPTIVE" not in os.environ  # set for its servers only: their governor is off
    for log in ("pagedserve-server.log", "pagedserve-server-2.log", "pagedserve-sync-server-2.log"):  # 2: fresh
        assert "contention:" not in (tmp_path / "out" / log).read_text(), log
    out = capsys.readouterr()
    s = _result(out.out)["workloads"]["fixed"]
    assert s["greedy_match"]["pagedserve-sync"]["identical"] == 4
    rounds = re.findall(r"round \d/2 fixed (\S+): ([\d.]+) s in its slices \(([\d.]+) s of wall clock\)", out.err)
    assert sorted(e for e, _, _ in rounds) == ["pagedserve"] * 2 + ["pagedserve-sync"] * 2, out.err
    assert all(0 < float(a) < float(w) for _, a, w in rounds), rounds
    for e in ("pagedserve", "pagedserve-sync"):  # the JSON's times are the slices' sums
        assert s["engines"][e]["seconds"] == pytest.approx([float(a) for e2, a, _ in rounds if e2 == e], abs=0.006)
    # --roofline: each round's probe rate and the schedule's least time at it; each engine's share of it.
    _check_roofline(s, model, peers.build_workload("fixed", 4, 0, 1000, 4096, 150), ["pagedserve", "pagedserve-sync"])
    for e in ("pagedserve", "pagedserve-sync"):  # sliced: one rate for the round, the engines' alike
        assert s["roofline"]["rounds"][e] == s["roofline"]["rounds"]["pagedserve"]
    assert len(re.findall(r"fixed \S+, \S+: probe read", out.err)) == 2, out.err  # read once a round
    assert "of the least time (median); an engine at it:" in out.out


class _Logger:
    """An engine of one process that logs a timestamp every 5 ms, 100 times; stopped until sliced."""

    def __init__(self, log: Path) -> None:
        import signal
        import subprocess
        import sys

        self.log = log
        code = ("import sys, time\nwith open(sys.argv[1], 'a') as f:\n    for _ in range(100):\n"
                "        f.write(f'{time.time()}\\n'); f.flush(); time.sleep(0.005)")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(log)])
        self.proc.send_signal(signal.SIGSTOP)  # before the interpreter is up: nothing logged yet

    def pids(self) -> list[int]:
        return [self.proc.pid]

    def run(self, workload: str) -> RunResult:
        import time

        t0 = time.perf_counter()
        self.proc.wait()
        return RunResult(time.perf_counter() - t0, [], None)


def test_a_sliced_round_runs_one_engine_at_a_time(tmp_path: Path) -> None:
    """Two processes that log a timestamp every 5 ms, sliced 50 ms each in turn: their logs
    alternate in runs (a few dozen switches), where left to run at once they would interleave
    at nearly every line; each one's time is about its own 0.5 s of work."""
    from benchmarks.peer_slices import sliced_round

    engines = {"a": _Logger(tmp_path / "a"), "b": _Logger(tmp_path / "b")}
    try:
        out = sliced_round(engines, ["a", "b"], "w", 0.05)  # type: ignore[arg-type]
    finally:
        for e in engines.values():
            e.proc.kill()
    stamps = sorted([(float(t), e) for e in "ab" for t in (tmp_path / e).read_text().split()])
    assert len(stamps) == 200
    switches = sum(x[1] != y[1] for x, y in zip(stamps, stamps[1:]))
    assert 4 <= switches <= 60, switches
    for run, secs in out.values():
        assert 0.45 <= secs <= 3 and run.seconds > secs, (secs, run.seconds)


def test_the_read_probe_reads_in_slices_of_its_own(tmp_path: Path) -> None:
    """--roofline's probe takes a turn after the engines': its whole samples (those no stop cut
    through) hold none of an engine's timestamps, it sampled while the round ran, and nothing
    after; its rate is a memory read rate, and close() leaves no process."""
    from benchmarks.peer_slices import ReadProbe, sliced_round

    probe = ReadProbe("smol")
    try:
        assert 50 < probe.peak_gflop_s < 1e5
        engines = {"a": _Logger(tmp_path / "a"), "b": _Logger(tmp_path / "b")}
        try:
            first = len(probe.samples)
            sliced_round(engines, ["a", "b"], "w", 0.05, probe)  # type: ignore[arg-type]
        finally:
            for e in engines.values():
                e.proc.kill()
        rate, got = probe.rate_since(first), probe.samples[first:]
        cut = 3 * sorted(s for s, _, _ in got)[len(got) // 2]
        whole = [(end - s, end) for s, _, end in got if s <= cut]
        assert len(whole) >= 3, got
        stamps = [float(t) for e in "ab" for t in (tmp_path / e).read_text().split()]
        inside = [t for t in stamps if any(a < t < b for a, b in whole)]
        assert not inside, (inside, whole)
        assert 1 < rate < 1000, rate  # GB/s: 212 MB a step, beyond the caches
        count = len(probe.samples)
        import time
        time.sleep(0.3)
        assert len(probe.samples) == count  # stopped between rounds
    finally:
        probe.close()
    assert probe.proc.poll() is not None
