"""``python -m benchmarks.llamacpp``: pagedserve against llama.cpp's
``llama-server`` on the same GGUF file, measured from outside over HTTP.

Scenarios (issue 40, acceptance 2 and 3):
- ``single``: one request, 64 prompt tokens, 256 output tokens;
- ``many``: the 64 ShareGPT-like requests (lengths x0.25, as ``benchmarks peers``), all sent at once;
- ``streams8``: eight of ``single``'s requests at once (acceptance 6: the 1B shape's Q8_0 file against its
  bf16 at 1 and 8 streams).

Engines, each a fresh process per run, started before and stopped after its timed part:
- ``pagedserve``: ``pagedserve serve FILE.gguf`` (blocks kept quantized), ``--dtype`` as given;
- ``pagedserve-bf16``: the same file dequantized to bfloat16 (``PAGEDSERVE_GGUF_DEQUANTIZE=1``), the bar of
  acceptance 3;
- ``pagedserve-fp32``: the blocks with fp32 activations (two int8 terms each: the default ``--dtype auto``
  on a CPU), beside ``pagedserve``'s ``--dtype`` (bfloat16 unless given), for what the precision costs;
- ``llama.cpp``: ``llama-server -m FILE -np <streams> -t 2`` (scripts/build-llama-cpp.sh builds it).

Every engine gets the same prompt token ids and output lengths through the same client
(``/v1/completions``, greedy, EOS ignored). A run's tok/s is the output tokens over the time from the
first request sent to the last answer. Runs interleave the engines (rotated order), ``--runs`` times;
the table gives medians and the ratios pagedserve / llama.cpp. Writes JSON to ``--out``.

    python -m benchmarks.llamacpp --files Q8_0,Q4_1 --scenarios single,many --runs 3
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pagedserve.bench.workloads import machine_info, sample_lengths, synthetic_prompt
from pagedserve.common.default_model import cache_dir, gguf_path

Work = list[tuple[list[int], int]]
VOCAB = 49152  # SmolLM2's
SHAREGPT_SCALE = 0.25  # as benchmarks peers: about 5,900 output tokens over 64 requests at seed 0
ENGINES = ("pagedserve", "pagedserve-bf16", "llama.cpp")
START_TIMEOUT_S = 900.0


def llama_bin() -> Path:
    return Path(os.environ.get("PAGEDSERVE_LLAMA_CPP", cache_dir() / "llama.cpp")) / "bin" / "llama-server"


def model_file(name: str) -> str:
    """Q4_1: the embedded SmolLM2 file; Q8_0: scripts/make-gguf-q8.py's; else a path."""
    if name == "Q4_1":
        return str(gguf_path())
    if name == "Q8_0":
        path = cache_dir() / "SmolLM2-135M-Instruct.Q8_0.gguf"
        if not path.is_file():
            script = Path(__file__).resolve().parents[1] / "scripts" / "make-gguf-q8.py"
            subprocess.run([sys.executable, str(script), "--out", str(path)], check=True)
        return str(path)
    return name


def workload(scenario: str, seed: int = 0) -> Work:
    if scenario == "single":
        return [(synthetic_prompt(64, seed, VOCAB), 256)]
    if scenario == "streams8":
        return [(synthetic_prompt(64, seed * 1_000_003 + i, VOCAB), 256) for i in range(8)]
    work = []
    for i, r in enumerate(sample_lengths("sharegpt", 64, seed)):
        p = max(1, min(round(r.prompt_len * SHAREGPT_SCALE), 1024))
        o = max(1, min(round(r.output_len * SHAREGPT_SCALE), 2047 - p))
        work.append((synthetic_prompt(p, seed * 1_000_003 + i, VOCAB), o))
    return work


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - our own servers
            return int(r.status)
    except (urllib.error.URLError, OSError):
        return 0


class Server:
    """One engine's server process (its own session, so the whole tree stops together)."""

    def __init__(self, engine: str, path: str, streams: int, ctx: int, dtype: str, log: Path) -> None:
        self.port = _free_port()
        env = dict(os.environ)
        if engine == "llama.cpp":
            cmd = [str(llama_bin()), "-m", path, "-np", str(streams), "-t", "2", "-tb", "2",
                   "-c", str(ctx * streams), "--host", "127.0.0.1", "--port", str(self.port)]
            self.ready = f"http://127.0.0.1:{self.port}/health"
        else:
            cmd = [str(Path(sys.executable).with_name("pagedserve")), "serve", path, "--port", str(self.port),
                   "--grpc-port", str(_free_port()), "--max-num-seqs", str(max(streams, 1)),
                   "--max-model-len", str(ctx),
                   "--dtype", {"pagedserve-bf16": "bfloat16", "pagedserve-fp32": "float32"}.get(engine, dtype)]
            env["PAGEDSERVE_GGUF_DEQUANTIZE"] = "1" if engine == "pagedserve-bf16" else "0"
            self.ready = f"http://127.0.0.1:{self.port}/v1/models"
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        t0 = time.monotonic()
        while _get(self.ready) != 200:
            if self.proc.poll() is not None or time.monotonic() - t0 > START_TIMEOUT_S:
                self.stop()
                raise RuntimeError(f"{engine} did not start (see {log})")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def complete(port: int, prompt: list[int], max_tokens: int) -> int:
    """One greedy completion over HTTP; returns the output tokens the server reports."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": False}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:  # noqa: S310 - our own servers
        out = json.loads(r.read())
    return int(out["usage"]["completion_tokens"])


def timed(port: int, work: Work) -> dict[str, float]:
    """All of ``work`` at once; (output tokens, seconds, tok/s)."""
    counts = [0] * len(work)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            counts[i] = complete(port, *work[i])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(work))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    want = sum(o for _, o in work)
    if sum(counts) != want:
        raise RuntimeError(f"{sum(counts)} output tokens, expected {want}")
    return {"tokens": want, "seconds": seconds, "tok_s": want / seconds}


def run_one(engine: str, path: str, scenario: str, dtype: str, log: Path) -> dict[str, float]:
    work = workload(scenario)
    ctx = -(-max(len(p) + o for p, o in work) // 256) * 256 + 256
    server = Server(engine, path, len(work), ctx, dtype, log)
    try:
        complete(server.port, synthetic_prompt(16, 99, VOCAB), 8)  # warm-up, untimed
        return timed(server.port, work)
    finally:
        server.stop()


# Issue 40's bars: single stream at least 1.0x llama.cpp (acceptance 2); many streams at least 3x
# llama.cpp and no slower than pagedserve's own bf16 on the same workload (acceptance 3); at 1 and 8
# streams (single, streams8) the blocks faster than the same model in bf16 (acceptance 6).
BARS = {"single": {"vs_llama_cpp": 1.0, "vs_own_bf16": 1.0}, "many": {"vs_llama_cpp": 3.0, "vs_own_bf16": 1.0},
        "streams8": {"vs_own_bf16": 1.0}}


def verdict(scenario: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Each bar of the scenario against the medians: {bar: {"ratio", "bar", "pass"}} (None: not measured)."""
    ratios = {"vs_llama_cpp": entry.get("ratio_vs_llama_cpp", {}).get("pagedserve"),
              "vs_own_bf16": entry.get("ratio_quant_vs_bf16")}
    return {name: None if ratios[name] is None else {"ratio": ratios[name], "bar": bar, "pass": ratios[name] >= bar}
            for name, bar in BARS.get(scenario, {}).items()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp", description=__doc__.split("\n\n")[0])
    p.add_argument("--files", default="Q8_0,Q4_1", help="Q8_0, Q4_1 (SmolLM2) or paths of GGUF files")
    p.add_argument("--scenarios", default="single,many")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="pagedserve's activations over the blocks")
    p.add_argument("--note", default="", help="stored with the results (e.g. 'shared machine')")
    p.add_argument("--out", default="llamacpp.json", help="JSON results (docs/results/ keeps the ones the docs cite)")
    args = p.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    if "llama.cpp" in engines and not llama_bin().is_file():
        print(f"no llama-server at {llama_bin()}: run scripts/build-llama-cpp.sh first", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="bench-llamacpp-"))
    res: dict[str, Any] = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "note": args.note, "dtype": args.dtype, "runs": args.runs, "engines": engines,
                           "baseline": "llama.cpp (llama-server, same file, -t 2); pagedserve-bf16 for acceptance 3",
                           "command": "python -m benchmarks llamacpp " + " ".join(argv), "results": {}}
    for f in args.files.split(","):
        path = model_file(f)
        for scenario in args.scenarios.split(","):
            key = f"{f}/{scenario}"
            runs: dict[str, list[float]] = {e: [] for e in engines}
            for r in range(args.runs):
                for e in engines[r % len(engines):] + engines[: r % len(engines)]:  # rotated: drift hits all
                    out = run_one(e, path, scenario, args.dtype, logs / f"{e}.log")
                    runs[e].append(out["tok_s"])
                    print(f"{key} run {r + 1} {e}: {out['tok_s']:.1f} tok/s ({out['tokens']} tokens in "
                          f"{out['seconds']:.1f} s)", flush=True)
            med = {e: statistics.median(v) for e, v in runs.items()}
            entry: dict[str, Any] = {"tok_s": runs, "median": med}
            if "llama.cpp" in med:
                entry["ratio_vs_llama_cpp"] = {e: med[e] / med["llama.cpp"] for e in med if e != "llama.cpp"}
            if "pagedserve-bf16" in med and "pagedserve" in med:
                entry["ratio_quant_vs_bf16"] = med["pagedserve"] / med["pagedserve-bf16"]
            if "pagedserve-fp32" in med and "pagedserve" in med:
                entry["ratio_fp32_activations"] = med["pagedserve-fp32"] / med["pagedserve"]
            entry["verdict"] = verdict(scenario, entry)
            res["results"][key] = entry
            print(f"{key}: medians {', '.join(f'{e} {v:.1f}' for e, v in med.items())} tok/s; "
                  f"ratios {json.dumps({k: round(v, 2) for k, v in entry.get('ratio_vs_llama_cpp', {}).items()})}; "
                  f"verdict {json.dumps(entry['verdict'])}",
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}; server logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
