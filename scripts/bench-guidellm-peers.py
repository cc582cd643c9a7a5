"""guidellm 0.8.1, with its own request bodies, against `pagedserve serve` and
`vllm serve` (vLLM's CPU build from .venv-peers), one server at a time, the
same constant rates and synthetic data for both (issue 23, acceptance 2).

    .venv/bin/python scripts/bench-guidellm-peers.py --guidellm /path/to/venv/bin/guidellm

Prints, per rate, TTFT and ITL p50/p99 of each server and pagedserve / vLLM.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from pagedserve.bench.serve_proc import start_serve
from pagedserve.bench.throughput import machine
from pagedserve.bench.vllm_server import start_vllm_serve
from pagedserve.common.default_model import resolve_model


def guidellm_run(exe: str, url: str, model_dir: str, profile: str, constraint: str, prompt: int, output: int,
                 out: Path) -> dict[str, Any]:
    argv = [exe, "run", "--backend", f"kind=openai_http,target={url},request_format=/v1/completions",
            "--profile", profile, "--constraint", constraint,
            "--data", f"kind=synthetic_text,prompt_tokens={prompt},output_tokens={output}",
            "--tokenizer", f"kind=hf_auto,model={model_dir}", "--output", f"kind=json,path={out}", "--disable-console"]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=tempfile.gettempdir(),
                       env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(Path.home())})
    if r.returncode != 0 or not out.exists():
        raise RuntimeError((r.stdout + r.stderr)[-3000:])
    return json.loads(out.read_text())["benchmarks"][0]


def figures(bench: dict[str, Any]) -> dict[str, float]:
    m = bench["metrics"]

    def pct(name: str, p: str) -> float:
        return float(m[name]["successful"]["percentiles"][p])

    return {"ttft_p50": pct("time_to_first_token_ms", "p50"), "ttft_p99": pct("time_to_first_token_ms", "p99"),
            "itl_p50": pct("inter_token_latency_ms", "p50"), "itl_p99": pct("inter_token_latency_ms", "p99"),
            "output_tok_s": float(m["output_tokens_per_second"]["successful"]["mean"]),
            "ok": m["request_totals"]["successful"], "errored": m["request_totals"]["errored"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guidellm", required=True, help="the guidellm executable (its own venv)")
    p.add_argument("--rates", default="1,2,3")
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--keep", default=None, help="folder to keep guidellm's JSON reports in")
    p.add_argument("--servers", default="pagedserve,vllm", help="which to run, in this order")
    p.add_argument("--launch", default="--device cpu --dtype float32 --kv-cache-memory 1GiB")
    args = p.parse_args()
    model_dir = resolve_model(None)
    rates = [float(x) for x in args.rates.split(",")]
    print(f"machine: {machine()}", flush=True)
    results: dict[str, dict[float, dict[str, float]]] = {name: {} for name in args.servers.split(",")}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for name in results:  # one server at a time, all rates on it
            srv: Any = (start_serve(args.launch.split()) if name == "pagedserve"
                        else start_vllm_serve(model_dir, "SmolLM2-135M-Instruct", 2048, 256))
            url = srv.http_url if name == "pagedserve" else srv.url
            try:
                # Warm-up, not counted: the first requests of a fresh server pay one-time costs.
                guidellm_run(args.guidellm, url, model_dir, "kind=concurrent,streams=8", "kind=max_requests,count=16",
                             args.prompt_tokens, args.output_tokens, Path(tmp) / f"{name}-warm.json")
                for rate in rates:
                    b = guidellm_run(args.guidellm, url, model_dir, f"kind=constant,rate={rate}",
                                     f"kind=max_duration,seconds={args.seconds}", args.prompt_tokens,
                                     args.output_tokens, Path(tmp) / f"{name}-{rate}.json")
                    results[name][rate] = figures(b)
                    print(name, rate, results[name][rate], flush=True)
            finally:
                srv.stop()
    if len(results) < 2:
        return 0
    print(f"{'rate':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>6}  (pagedserve / vLLM)")
    for rate in rates:
        a, b = results["pagedserve"][rate], results["vllm"][rate]
        print(f"{rate:>5g} " + " ".join(f"{a[k] / b[k]:>8.2f}x" for k in
                                       ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "output_tok_s")))
    print(json.dumps({"bench": "guidellm-peers", "machine": machine(), "args": vars(args),
                      "results": {k: {str(r): v for r, v in d.items()} for k, d in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
