"""``pagedserve bench serving``: a load generator against a running server.

Requests arrive as a Poisson process (``--rate`` req/s; ``inf`` sends all at
once) with ShareGPT-like or Alpaca-like prompt/output lengths
(``bench.workloads``), scaled down with ``--max-total-len`` for small models;
prompts are random token ids, every request generates exactly its sampled
output length (``ignore_eos``). Over gRPC (``--addr``) or the OpenAI HTTP
gateway (``--http``). ``--launch "ARGS"`` starts ``pagedserve serve ARGS``
itself on a free port (e.g. ``--launch "--worker sim"``: the frontend and
scheduler under load with the SIMULATED worker behind them). The same load
against ``vllm serve`` beside ours is ``python -m benchmarks serving --peer vllm``
(the repository's benchmarks/, outside the wheel), which calls ``run`` here
with a peer step.

Reports request and token throughput, TTFT / ITL / TPOT / end-to-end
percentiles, goodput (completed requests per second that met the SLO:
TTFT <= --slo-ttft-ms and mean TPOT <= --slo-tpot-ms), refusals
(RESOURCE_EXHAUSTED / 429) and failures, and the achieved request rate as a
ratio of the offered one. The last line is one JSON object
(``{"bench": "serving", ...}``); numbers from a server whose worker is
simulated carry ``"simulated": true`` and say so in the text.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedserve.common.env import env
from pagedserve.bench.serve_proc import ServeProc, start_serve
from pagedserve.bench.workloads import machine_info, poisson_arrivals, sample_lengths, synthetic_prompt


@dataclass
class Record:
    prompt_len: int
    output_len: int
    sent: float = 0.0
    first: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    done: float | None = None
    tokens: int = 0
    outcome: str = "pending"  # ok | rejected | failed


def plan(workload: str, n: int, seed: int, max_total: int, vocab: int) -> list[tuple[list[int], int]]:
    """Prompt ids and output lengths, scaled so prompt + output <= max_total."""
    out = []
    for i, r in enumerate(sample_lengths(workload, n, seed)):
        scale = min(1.0, max_total / r.total)
        p = max(1, int(r.prompt_len * scale))
        o = max(1, min(int(r.output_len * scale), max_total - p))
        out.append((synthetic_prompt(p, seed * 1_000_003 + i, vocab), o))
    return out


async def _grpc_one(stub: Any, pb: Any, md: Any, ids: list[int], out_len: int, rec: Record) -> None:
    import grpc

    req = pb.GenerateRequest(sampling_params=pb.SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True))
    req.prompt_token_ids.ids.extend(ids)
    rec.sent = time.perf_counter()
    try:
        async for resp in stub.Generate(req, metadata=md):
            k = sum(len(o.token_ids) for o in resp.outputs)
            if k:
                now = time.perf_counter()
                rec.first = rec.first or now
                rec.chunk_times.append(now)
                rec.tokens += k
        rec.done, rec.outcome = time.perf_counter(), "ok"
    except grpc.aio.AioRpcError as e:
        rec.outcome = "rejected" if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "failed"


async def _http_one(session: Any, url: str, headers: dict[str, str], model: str, ids: list[int], out_len: int,
                    rec: Record) -> None:
    body = {"model": model, "prompt": ids, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
            "stream": True}
    rec.sent = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                rec.outcome = "rejected" if r.status == 429 else "failed"
                return
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                payload = json.loads(line[6:])
                if payload.get("choices"):
                    now = time.perf_counter()
                    rec.first = rec.first or now
                    rec.chunk_times.append(now)
                    rec.tokens += 1  # SSE events, not tokens; throughput uses the requested lengths
        rec.done, rec.outcome = time.perf_counter(), "ok"
    except Exception:  # noqa: BLE001 - any transport failure counts as failed
        rec.outcome = "failed"


async def run_load(args: argparse.Namespace, work: list[tuple[list[int], int]], arrivals: list[float],
                   model: str) -> tuple[list[Record], float]:
    """Opens the client (HTTP session or gRPC channel) and sends one untimed
    request through it before the clock starts: the load generator's own
    imports and first connection shared the two cores with the first timed
    step (measured: 178 ms instead of 47 for one 17-token prefill, the TTFT
    p99 of 64 requests)."""
    recs = [Record(len(ids), o) for ids, o in work]
    if args.http:
        import aiohttp

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            await _http_one(session, args.http, headers, model, [1, 2, 3], 2, Record(3, 2))
            t0 = time.perf_counter()
            tasks = []
            for (ids, o), at, rec in zip(work, arrivals, recs):
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                tasks.append(asyncio.create_task(_http_one(session, args.http, headers, model, ids, o, rec)))
            await asyncio.gather(*tasks)
    else:
        import grpc

        from pagedserve.v1 import generation_pb2 as pb
        from pagedserve.v1 import generation_pb2_grpc as pb_grpc

        md = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else None
        async with grpc.aio.insecure_channel(args.addr) as ch:
            stub = pb_grpc.GenerationStub(ch)
            await _grpc_one(stub, pb, md, [1, 2, 3], 2, Record(3, 2))
            t0 = time.perf_counter()
            tasks = []
            for (ids, o), at, rec in zip(work, arrivals, recs):
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                tasks.append(asyncio.create_task(_grpc_one(stub, pb, md, ids, o, rec)))
            await asyncio.gather(*tasks)
    return recs, time.perf_counter() - t0


def detailed(recs: list[Record], server: str) -> list[dict[str, Any]]:
    """One row per request, in ms, send times from the first send: what the
    quantiles hide (which requests make the tail, and what they asked)."""
    def ms(t: float | None, since: float) -> float | None:
        return None if t is None else round((t - since) * 1000.0, 3)

    t0 = min((r.sent for r in recs), default=0.0)
    return [{"server": server, "index": i, "prompt_len": r.prompt_len, "output_len": r.output_len,
             "outcome": r.outcome, "sent_ms": ms(r.sent, t0), "ttft_ms": ms(r.first, r.sent),
             "e2e_ms": ms(r.done, r.sent)} for i, r in enumerate(recs)]


def _save_detailed(path: str | None, recs: list[Record], server: str, mode: str) -> None:
    if path is not None:
        with open(path, mode) as f:
            f.writelines(json.dumps(row) + "\n" for row in detailed(recs, server))


def _pct(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(xs) * 1000.0
    return {"mean": round(float(a.mean()), 3), "p50": round(float(np.percentile(a, 50)), 3),
            "p90": round(float(np.percentile(a, 90)), 3), "p99": round(float(np.percentile(a, 99)), 3)}


def summarize(recs: list[Record], duration: float, args: argparse.Namespace, simulated: bool) -> dict[str, Any]:
    ok = [r for r in recs if r.outcome == "ok"]
    ttft = [r.first - r.sent for r in ok if r.first is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [(r.done - r.first) / (r.output_len - 1) for r in ok
            if r.first is not None and r.done is not None and r.output_len > 1]
    e2e = [r.done - r.sent for r in ok if r.done is not None]
    good = [r for r in ok if r.first is not None and (r.first - r.sent) * 1000 <= args.slo_ttft_ms and
            (r.output_len <= 1 or (r.done - r.first) / (r.output_len - 1) * 1000 <= args.slo_tpot_ms)]  # type: ignore[operator]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    offered = len(recs) / args.offered_span if args.offered_span else None
    return {
        "bench": "serving", "protocol": "http" if args.http else "grpc", "workload": args.workload,
        "simulated": simulated, "num_requests": len(recs), "completed": len(ok),
        "rejected": sum(r.outcome == "rejected" for r in recs), "failed": sum(r.outcome == "failed" for r in recs),
        "rate": None if math.isinf(args.rate) else args.rate, "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "achieved_over_offered": round((len(ok) / duration) / offered, 3) if offered else None,
        "output_token_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 2),
        "ttft_ms": _pct(ttft), "itl_ms": _pct(itl), "tpot_ms": _pct(tpot), "e2e_ms": _pct(e2e),
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "goodput_rps": round(len(good) / duration, 3), "slo_attainment": round(len(good) / max(1, len(recs)), 3),
        "machine": machine_info(),
    }


def _model_info(args: argparse.Namespace) -> Any:
    import grpc

    from pagedserve.client import GenerationClient

    with GenerationClient(args.addr, api_key=args.api_key) as c:
        try:
            return c.model_info()
        except grpc.RpcError as e:
            raise SystemExit(f"cannot reach {args.addr}: {e.code().name}: {e.details()}") from None


def _print(res: dict[str, Any], args: argparse.Namespace, server: str) -> None:
    label = " (SIMULATED worker)" if res["simulated"] else ""
    print(f"{server} bench serving{label}: {res['protocol']}, {args.workload}-like, "
          f"{res['num_requests']} requests at {args.rate} req/s on {res['machine']}")
    print(f"  completed {res['completed']}, rejected {res['rejected']}, failed {res['failed']} "
          f"in {res['duration_s']} s")
    print(f"  throughput {res['request_throughput']} req/s, {res['output_token_throughput']} output tok/s "
          f"(achieved/offered rate {res['achieved_over_offered']})")
    for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        print(f"  {k:8s} " + ", ".join(f"{q} {v}" for q, v in res[k].items()))
    print(f"  goodput {res['goodput_rps']} req/s under TTFT <= {args.slo_ttft_ms} ms, "
          f"TPOT <= {args.slo_tpot_ms} ms ({res['slo_attainment']:.0%} of requests)")


def warm_up(url: str, model: str, api_key: str | None) -> None:
    import urllib.request

    body = json.dumps({"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body, headers), timeout=600) as r:
        r.read()


# After our run: the same work and arrival times against another server (benchmarks/serving.py).
PeerRun = Callable[[argparse.Namespace, Any, list[tuple[list[int], int]], list[float], dict[str, Any]], int]


def parser(prog: str = "pagedserve bench serving") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--addr", default="127.0.0.1:50051", help="gRPC address (also used for model info)")
    p.add_argument("--http", default=None, help="base URL of the HTTP gateway: load it instead of gRPC")
    p.add_argument("--api-key", default=env("API_KEY"))
    p.add_argument("--launch", default=None, metavar="ARGS", help="start `pagedserve serve ARGS` for the run")
    p.add_argument("--workload", default="sharegpt", choices=["sharegpt", "alpaca"])
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-total-len", type=int, default=None,
                   help="scale each request so prompt + output fit (default: the model's max_model_len)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--save-detailed", default=None, metavar="PATH",
                   help="write one JSON line per request and server (prompt and output length, send time, "
                        "TTFT, end-to-end; ms)")
    return p


def main(argv: list[str]) -> int:
    return run(parser().parse_args(argv))


def run(args: argparse.Namespace, peer: PeerRun | None = None) -> int:
    """One load against our server; then, with ``peer``, the same against another over HTTP."""
    server: ServeProc | None = None
    if args.launch is not None:
        server = start_serve(args.launch.split(), echo=True)
        args.addr = server.grpc_addr
        if peer is not None and not args.http:
            if server.http_url is None:
                raise SystemExit("this `pagedserve serve` has no HTTP API; --peer compares over HTTP")
            args.http = server.http_url
    if peer is not None and not args.http:
        raise SystemExit("--peer compares over HTTP: give --http URL (or --launch)")
    try:
        info = _model_info(args)
        simulated = info.model_name.startswith("simulated")
        max_total = min(args.max_total_len or info.max_model_len, info.max_model_len - 1)
        work = plan(args.workload, args.num_requests, args.seed, max_total, info.vocab_size)
        arrivals = [0.0] * len(work) if math.isinf(args.rate) else poisson_arrivals(len(work), args.rate, args.seed)
        args.offered_span = arrivals[-1] if arrivals and arrivals[-1] > 0 else None
        if peer is not None:
            warm_up(args.http, info.model_name, args.api_key)  # both servers get one, so neither pays a first call
        recs, duration = asyncio.run(run_load(args, work, arrivals, info.model_name))
        res = summarize(recs, duration, args, simulated)
        _save_detailed(args.save_detailed, recs, "pagedserve", "w")
        _print(res, args, "pagedserve")
        print(json.dumps(res))
        if peer is not None:
            if simulated:
                raise SystemExit("--peer needs a real model worker, not the SIMULATED one")
            if server is not None:  # idle, but its processes would still share the cores with vLLM
                server.stop()
                server = None
            return peer(args, info, work, arrivals, {**res, "server": "pagedserve"})
        return 0 if res["failed"] == 0 else 1
    finally:
        if server is not None:
            server.stop()
