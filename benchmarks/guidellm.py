"""Running guidellm (its own venv, its own request bodies) against an OpenAI-style
server: one `guidellm run` to a JSON report, the untimed warm-up before timed
runs, the figures issue 23 compares, and each request's send time and TTFT. Used by `python -m benchmarks guidellm-peers` (benchmarks/guidellm_peers.py)
and the experiments beside it."""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any


def guidellm_run(exe: str, url: str, model_dir: str, profile: str, constraint: str, prompt: int, output: int,
                 out: Path) -> dict[str, Any]:
    """One `guidellm run` against ``url`` (streaming `/v1/completions`, synthetic
    prompts); its first benchmark from the JSON report at ``out``."""
    argv = [exe, "run", "--backend", f"kind=openai_http,target={url},request_format=/v1/completions",
            "--profile", profile, "--constraint", constraint,
            "--data", f"kind=synthetic_text,prompt_tokens={prompt},output_tokens={output}",
            "--tokenizer", f"kind=hf_auto,model={model_dir}", "--output", f"kind=json,path={out}", "--disable-console"]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=tempfile.gettempdir(),
                       env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(Path.home())})
    if r.returncode != 0 or not out.exists():
        raise RuntimeError((r.stdout + r.stderr)[-3000:])
    return dict(json.loads(out.read_text())["benchmarks"][0])


def warm_up(exe: str, url: str, model_dir: str, prompt: int, output: int, out: Path) -> None:
    """Not counted: the first requests of a fresh server pay one-time costs."""
    guidellm_run(exe, url, model_dir, "kind=concurrent,streams=8", "kind=max_requests,count=16", prompt, output, out)


def figures(bench: dict[str, Any]) -> dict[str, float]:
    m = bench["metrics"]

    def pct(name: str, p: str) -> float:
        return float(m[name]["successful"]["percentiles"][p])

    return {"ttft_p50": pct("time_to_first_token_ms", "p50"), "ttft_p99": pct("time_to_first_token_ms", "p99"),
            "itl_p50": pct("inter_token_latency_ms", "p50"), "itl_p99": pct("inter_token_latency_ms", "p99"),
            "output_tok_s": float(m["output_tokens_per_second"]["successful"]["mean"]),
            "ok": m["request_totals"]["successful"], "errored": m["request_totals"]["errored"]}


def sends_and_ttfts(bench: dict[str, Any]) -> list[tuple[float, float]]:
    """(send time, Unix s; TTFT, ms) of each successful request of a
    ``guidellm_run`` report, in send order, from guidellm's own timestamps."""
    timings = sorted((r["info"]["timings"] for r in bench["requests"]["successful"]),
                     key=lambda t: t["request_start"])
    return [(t["request_start"], (t["first_token_iteration"] - t["request_start"]) * 1000) for t in timings]
