"""guidellm 0.8.1, with its own request bodies, against `pagedserve serve` and
`vllm serve` (vLLM's CPU build from .venv-peers), one server at a time, the
same constant rates and synthetic data for both (issue 23, acceptance 2).

    .venv/bin/python -m benchmarks guidellm-peers --guidellm /path/to/venv/bin/guidellm

Prints, per rate, TTFT and ITL p50/p99 of each server and pagedserve / vLLM.

--sessions: where the servers are started. "shared" (the default, and every
run before 2026-12-06): in this script's session, beside guidellm. "own": each
server in a session of its own, as a service manager or a second terminal starts
it; with the kernel's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled)
a session's processes share the CPU with guidellm's as one group. `pagedserve
serve` keeps its four components in its own session (before 2026-12-06 each had a
session of its own). "own,shared" runs both.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.guidellm import figures, guidellm_run, warm_up
from benchmarks.vllm_server import start_vllm_serve
from pagedserve.bench.serve_proc import start_serve
from pagedserve.bench.throughput import machine
from pagedserve.common.default_model import resolve_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks guidellm-peers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guidellm", required=True, help="the guidellm executable (its own venv)")
    p.add_argument("--rates", default="1,2,3")
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--keep", default=None, help="folder to keep guidellm's JSON reports in")
    p.add_argument("--servers", default="pagedserve,vllm", help="which to run, in this order")
    p.add_argument("--launch", default="--device cpu --dtype float32 --kv-cache-memory 1GiB")
    p.add_argument("--sessions", default="shared", help="shared, own or own,shared (see above)")
    args = p.parse_args(argv)
    model_dir = resolve_model(None)
    rates = [float(x) for x in args.rates.split(",")]
    sessions = args.sessions.split(",")
    if not set(sessions) <= {"own", "shared"}:
        p.error(f"--sessions: own and/or shared, not {args.sessions}")
    print(f"machine: {machine()}; autogroup: {autogroup()}", flush=True)
    every: dict[str, dict[str, dict[str, dict[float, dict[str, float]]]]] = {}
    for session in sessions:
        print(f"servers in {session} session", flush=True)
        results = run_servers(args, model_dir, rates, own=session == "own")
        every[session] = {k: {str(r): v for r, v in d.items()} for k, d in results.items()}
        if len(results) == 2:
            print_ratios(results, rates)
    print(json.dumps({"bench": "guidellm-peers", "machine": machine(), "args": vars(args), "results": every}))
    return 0


def autogroup() -> str:
    try:
        return "on" if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1" else "off"
    except OSError:
        return "unknown"


def print_ratios(results: dict[str, dict[float, dict[str, float]]], rates: list[float]) -> None:
    print(f"{'rate':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>6}  (pagedserve / vLLM)")
    for rate in rates:
        a, b = results["pagedserve"][rate], results["vllm"][rate]
        print(f"{rate:>5g} " + " ".join(f"{a[k] / b[k]:>8.2f}x" for k in
                                       ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "output_tok_s")), flush=True)


def run_servers(args: argparse.Namespace, model_dir: str, rates: list[float],
                own: bool) -> dict[str, dict[float, dict[str, float]]]:
    results: dict[str, dict[float, dict[str, float]]] = {name: {} for name in args.servers.split(",")}
    tag = "" if own else "-shared"
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for name in results:  # one server at a time, all rates on it
            srv: Any = (start_serve(args.launch.split(), own_session=own) if name == "pagedserve"
                        else start_vllm_serve(model_dir, "SmolLM2-135M-Instruct", 2048, 256, own_session=own))
            url = srv.http_url if name == "pagedserve" else srv.url
            try:
                warm_up(args.guidellm, url, model_dir, args.prompt_tokens, args.output_tokens,
                        Path(tmp) / f"{name}{tag}-warm.json")
                for rate in rates:
                    b = guidellm_run(args.guidellm, url, model_dir, f"kind=constant,rate={rate}",
                                     f"kind=max_duration,seconds={args.seconds}", args.prompt_tokens,
                                     args.output_tokens, Path(tmp) / f"{name}{tag}-{rate}.json")
                    results[name][rate] = figures(b)
                    print(name, rate, results[name][rate], flush=True)
            finally:
                srv.stop()
    return results


if __name__ == "__main__":
    raise SystemExit(main())
