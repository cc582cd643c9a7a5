"""``python -m benchmarks serving --peer vllm``: ``pagedserve bench serving`` (the same
flags and load), then the same requests at the same arrival times over HTTP to
``vllm serve`` from ``.venv-peers`` (started here on the embedded model or
``--peer-model``); prints both reports and the pagedserve / vLLM latency ratios. Each
server gets one warm-up request first, and ours is stopped before vLLM's run."""
from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from benchmarks.vllm_server import start_vllm_serve
from pagedserve.bench import serving


def ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """pagedserve / peer for each latency quantile (below 1: pagedserve is faster)."""
    out: dict[str, float | None] = {}
    for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        for q in ("p50", "p99"):
            a, b = ours[k][q], peer[k][q]
            out[f"{k}_{q}"] = round(a / b, 3) if a is not None and b else None
    return out


def vllm_run(args: argparse.Namespace, info: Any, work: list[tuple[list[int], int]], arrivals: list[float],
             ours: dict[str, Any]) -> int:
    """The same load against `vllm serve` (.venv-peers) on the same model; prints both and the ratios."""
    from pagedserve.common.default_model import resolve_model

    model_dir = resolve_model(args.peer_model)
    print(f"bench serving: starting vllm serve on {model_dir}", flush=True)
    srv = start_vllm_serve(model_dir, info.model_name, info.max_model_len, max(256, len(work)))
    try:
        peer_args = argparse.Namespace(**{**vars(args), "http": srv.url, "api_key": None})
        serving.warm_up(srv.url, info.model_name, None)
        recs, duration = asyncio.run(serving.run_load(peer_args, work, arrivals, info.model_name))
        peer = {**serving.summarize(recs, duration, peer_args, False), "server": "vllm"}
        serving._save_detailed(args.save_detailed, recs, "vllm", "a")
    finally:
        srv.stop()
    serving._print(peer, args, "vllm")
    r = ratios(ours, peer)
    print(f"ratio pagedserve / vllm (below 1: pagedserve lower latency): TTFT p50 {r['ttft_ms_p50']}, "
          f"p99 {r['ttft_ms_p99']}; ITL p50 {r['itl_ms_p50']}, p99 {r['itl_ms_p99']}")
    print(json.dumps({"bench": "serving-peers", "rate": ours["rate"], "workload": args.workload,
                      "pagedserve": ours, "vllm": peer, "ratio_pagedserve_over_vllm": r}))
    return 0 if ours["failed"] == 0 and peer["failed"] == 0 else 1


def main(argv: list[str]) -> int:
    p = serving.parser(prog="python -m benchmarks serving")
    p.add_argument("--peer", default="vllm", choices=["vllm"],
                   help="the server to compare with over HTTP: `vllm serve` from .venv-peers, which it starts")
    p.add_argument("--peer-model", default=None, help="HF folder for the peer (default: the embedded model)")
    return serving.run(p.parse_args(argv), peer=vllm_run)
