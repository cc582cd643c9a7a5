"""``pagedserve bench frontend_cpu``: the frontend's CPU-seconds per 1,000
streamed tokens (issue 23).

The REAL frontend process (``pagedserve frontend``: gRPC server, OpenAI
HTTP gateway, detokenizer, stop strings, metrics) is fed by a SIMULATED
scheduler (``frontend_cpu_engine``) that sends one token per running
request every ``--step-ms``, as decode steps do, so each stream gets one
token per step, not bursts. The tokens are real text in the model's
tokenizer (English, CJK, Cyrillic, emoji, symbols), so detokenization does
its real work. This process runs the clients: ``--concurrency`` streams at
a time, ``--requests`` in all, ``--max-tokens`` each, over gRPC and HTTP SSE
(/v1/completions, ``stream: true``). Only the frontend's own CPU time
(user + system, /proc via psutil) is counted, from the first request to
the last answer; its idle rate (watchdog, metrics) is measured over the
same span beforehand and reported, not subtracted.

Each protocol's streamed texts are hashed (sorted, so arrival order does not
matter): equal hashes before and after a change mean the same text.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from pagedserve.bench.serve_proc import free_port
from pagedserve.bench.workloads import machine_info

TEXT = ("The quick brown fox jumps over the lazy dog; café, naïve, jalapeño. 東京タワーは高いです。"
        "北京欢迎你！한국어 문장도 있습니다. Москва — столица России. Emoji: 🙂🎉👩‍💻🇫🇷 and symbols €, ±, →, ∑. "
        "def f(x):\n    return x ** 2  # code too\n\n")


# Runs module argv[2] (with the arguments after it) from another source folder
# (argv[1]: a folder holding a `pagedserve` package with its components inside),
# past the editable install's finder: a before/after comparison.
_FROM_SOURCE = (
    "import runpy, sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "sys.argv = [sys.argv[2], *sys.argv[3:]]\n"
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
)


def _module(name: str, frontend_from: str | None) -> list[str]:
    return [sys.executable, "-c", _FROM_SOURCE, frontend_from, name] if frontend_from else \
        [sys.executable, "-m", name]


@dataclass
class Result:
    protocol: str
    requests: int
    tokens: int
    wall_s: float
    cpu_s: float
    cpu_s_per_1k_tokens: float
    idle_cpu_s_per_s: float
    text_sha256: str
    texts_as_vllm: int  # streams whose text is the decoded ids up to the last whole character
    texts_as_decode: int  # streams whose text is the decoded ids, an incomplete end as U+FFFD


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


Streamed = tuple[list[int], str]  # one request's token ids and text


async def _grpc_one(addr: str, max_tokens: int) -> Streamed:
    from pagedserve.client import AsyncGenerationClient

    async with AsyncGenerationClient(addr) as c:
        col = await c.generate_all("Hello", max_tokens=max_tokens, temperature=0.0)
    ids, text, _ = col.result(0)
    return ids, text


async def _http_one(session: Any, url: str, max_tokens: int) -> Streamed:
    body = {"model": "bench", "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True}
    text: list[str] = []
    ids: list[int] = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                text.append(ch.get("text") or "")
                ids += ch.get("token_ids") or []
    return ids, "".join(text)


def text_checks(tok: Any, outs: list[Streamed]) -> tuple[int, int]:
    """How many streamed texts equal (vLLM's rule) the decoded ids up to the
    last whole character, and (the rule before issue 23) the decoded ids, an
    incomplete last character as U+FFFD. A byte-level tokenizer's text does
    not depend on the prompt before it."""
    whole = cut = 0
    for ids, text in outs:
        full = tok.decode(ids, skip_special_tokens=True)
        j = len(ids)
        while j and tok.decode(ids[:j], skip_special_tokens=True).endswith("\ufffd"):
            j -= 1
        cut += text == tok.decode(ids[:j], skip_special_tokens=True)
        whole += text == full
    return cut, whole


async def _load(protocol: str, grpc_addr: str, http_url: str, requests: int, concurrency: int,
                max_tokens: int) -> list[Streamed]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one() -> Streamed:
            async with sem:
                if protocol == "grpc":
                    return await _grpc_one(grpc_addr, max_tokens)
                return await _http_one(session, http_url, max_tokens)

        return list(await asyncio.gather(*(one() for _ in range(requests))))


def _wait_ready(url: str, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the frontend exited during start-up")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the frontend did not become healthy")


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(model: str, protocols: list[str], requests: int, concurrency: int, max_tokens: int, step_ms: float,
        log_dir: str | None = None, profile: str | None = None, frontend_from: str | None = None) -> list[Result]:
    from transformers import AutoTokenizer

    from pagedserve.common.default_model import resolve_model

    model_dir = resolve_model(model or None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    run_dir = tempfile.mkdtemp(prefix="pagedserve-fecpu-")
    ids_file = os.path.join(run_dir, "ids.json")
    with open(ids_file, "w") as f:
        json.dump(tok(TEXT * 8, add_special_tokens=False).input_ids, f)
    sin, sout = f"ipc://{run_dir}/scheduler_in.sock", f"ipc://{run_dir}/scheduler_out.sock"
    grpc_port, http_port = free_port(), free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    logs = [open(os.path.join(log_dir or run_dir, n), "w") for n in ("engine.log", "frontend.log")]
    engine = subprocess.Popen([sys.executable, "-m", "pagedserve.bench.frontend_cpu_engine", "--scheduler-in", sin,
                               "--scheduler-out", sout, "--ids", ids_file, "--step-ms", str(step_ms),
                               "--vocab-size", str(len(tok))], stdout=logs[0], stderr=subprocess.STDOUT, env=env)
    # `pagedserve frontend` leaves by os._exit, past cProfile's own dump: profiled() dumps first.
    entry = [sys.executable, "-m", "pagedserve.bench.frontend_cpu", "--profiled-frontend", profile] if profile \
        else [*_module("pagedserve", frontend_from), "frontend"]
    frontend = subprocess.Popen([*entry, "--model", model_dir,
                                 "--scheduler-in", sin, "--scheduler-out", sout, "--port", str(grpc_port),
                                 "--http-port", str(http_port), "--served-model-name", "bench",
                                 "--disable-log-stats"], stdout=logs[1], stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{http_port}"
    results = []
    try:
        _wait_ready(url, frontend, 300)
        fp = psutil.Process(frontend.pid)
        for protocol in protocols:
            asyncio.run(_load(protocol, f"127.0.0.1:{grpc_port}", url, 2, 2, 4))  # warm-up: first-use imports
            t0, c0 = time.monotonic(), _cpu(fp)
            outs = asyncio.run(_load(protocol, f"127.0.0.1:{grpc_port}", url, requests, concurrency, max_tokens))
            wall, cpu = time.monotonic() - t0, _cpu(fp) - c0
            i0 = _cpu(fp)
            time.sleep(min(wall, 5.0))
            idle = (_cpu(fp) - i0) / min(wall, 5.0)
            tokens = sum(len(ids) for ids, _ in outs)
            sha = hashlib.sha256("\x00".join(sorted(t for _, t in outs)).encode()).hexdigest()[:16]
            results.append(Result(protocol, requests, tokens, round(wall, 2), round(cpu, 3),
                                  round(1000 * cpu / max(tokens, 1), 4), round(idle, 4), sha, *text_checks(tok, outs)))
    finally:
        _stop(frontend)
        _stop(engine)
        for f in logs:
            f.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return results


def run_core(model: str, concurrency: int, max_tokens: int, frontend_from: str | None = None) -> Result:
    """``frontend_cpu_core`` in a process of its own (from ``frontend_from`` if given)."""
    from pagedserve.common.default_model import resolve_model
    from pagedserve.frontend.core.tokenizer import load

    model_dir = resolve_model(model or None)
    run = subprocess.run([*_module("pagedserve.bench.frontend_cpu_core", frontend_from), model_dir,
                          str(concurrency), str(max_tokens)], capture_output=True, text=True, timeout=600)
    if run.returncode:
        raise RuntimeError(run.stderr[-3000:])
    out = json.loads(run.stdout.strip().splitlines()[-1])
    texts: list[str] = out["texts"]
    tok = load(model_dir)
    ids = tok(TEXT * 8, add_special_tokens=False).input_ids
    streamed = [([ids[(i * 7919 + k) % len(ids)] for k in range(max_tokens)], t) for i, t in enumerate(texts)]
    sha = hashlib.sha256("\x00".join(sorted(texts)).encode()).hexdigest()[:16]
    return Result("core", concurrency, out["tokens"], 0.0, round(out["cpu_s"], 3),
                  round(1000 * out["cpu_s"] / out["tokens"], 4), 0.0, sha, *text_checks(tok, streamed))


class _DecodeOnly:
    """A tokenizer seen without its Rust backend: the detokenizer's Python loop (the path before issue 23)."""

    def __init__(self, tok: Any) -> None:
        self.decode = tok.decode


def run_detokenizer(model: str, repeat: int = 5) -> list[Result]:
    """The detokenizer alone, one stream of the bench's text, DecodeStream and the Python loop (best of ``repeat``)."""
    from pagedserve.common.default_model import resolve_model
    from pagedserve.frontend.core.detokenizer import IncrementalDetokenizer
    from pagedserve.frontend.core.tokenizer import load

    tok = load(resolve_model(model or None))
    ids = tok(TEXT * 8, add_special_tokens=False).input_ids
    results = []
    for name, t in (("detokenizer, DecodeStream", tok), ("detokenizer, Python loop", _DecodeOnly(tok))):
        best, text = float("inf"), ""
        for _ in range(repeat):
            d = IncrementalDetokenizer(t, [], True)
            c0 = time.process_time()
            text = "".join(d.add([i]) for i in ids)
            best = min(best, time.process_time() - c0)
        ok = int(text == tok.decode(ids, skip_special_tokens=True))
        results.append(Result(name, 1, len(ids), 0.0, round(best, 4), round(1000 * best / len(ids), 5), 0.0,
                              hashlib.sha256(text.encode()).hexdigest()[:16], ok, ok))
    return results


def profiled(out: str, argv: list[str]) -> int:
    """``pagedserve frontend ARGV`` under cProfile, its stats written to ``out``."""
    import cProfile

    from pagedserve.frontend.service import main as frontend_main

    prof = cProfile.Profile()
    prof.enable()
    try:
        return frontend_main(argv)
    finally:
        prof.disable()
        prof.dump_stats(out)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--profiled-frontend"]:
        return profiled(argv[1], argv[2:])
    p = argparse.ArgumentParser(prog="pagedserve bench frontend_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="its tokenizer is used (default: the embedded SmolLM2)")
    p.add_argument("--protocol", choices=("grpc", "http", "both"), default="both")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=20.0, help="the simulated decode step")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--detokenizer", action="store_true", help="the detokenizer alone: DecodeStream and the "
                                                              "Python loop over tokenizer.decode")
    p.add_argument("--core", action="store_true", help="the frontend's own work per token, no transport "
                                                       "(frontend_cpu_core, one process): --concurrency streams")
    p.add_argument("--profile", default=None, metavar="FILE", help="run the frontend under cProfile, stats to FILE")
    p.add_argument("--frontend-from", default=None, metavar="DIR",
                   help="run the frontend from this folder's `pagedserve` package (e.g. an older checkout laid "
                        "out as installed), for a before/after comparison")
    args = p.parse_args(argv)
    protocols = ["grpc", "http"] if args.protocol == "both" else [args.protocol]
    if args.detokenizer:
        results = run_detokenizer(args.model)
    elif args.core:
        results = [run_core(args.model, args.concurrency, args.max_tokens, args.frontend_from)]
    else:
        results = run(args.model, protocols, args.requests, args.concurrency, args.max_tokens, args.step_ms,
                      profile=args.profile, frontend_from=args.frontend_from)
    meta = {"machine": machine_info(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "concurrency": args.concurrency, "max_tokens": args.max_tokens, "step_ms": args.step_ms}
    if args.json:
        print(json.dumps({**meta, "results": [asdict(r) for r in results]}))
        return 0
    print(f"# frontend CPU per 1,000 streamed tokens ({meta['machine']}, {meta['date']}; "
          f"{args.concurrency} streams at a time, {args.max_tokens} tokens each, a step every {args.step_ms:g} ms)")
    print("| protocol | requests | tokens | wall s | frontend CPU s | CPU s / 1k tokens | idle CPU s/s | text sha256 "
          "| texts = decode, cut as vLLM | texts = decode, U+FFFD end |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.protocol} | {r.requests} | {r.tokens} | {r.wall_s} | {r.cpu_s} | {r.cpu_s_per_1k_tokens} | "
              f"{r.idle_cpu_s_per_s} | {r.text_sha256} | {r.texts_as_vllm} | {r.texts_as_decode} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
