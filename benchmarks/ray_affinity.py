"""``python -m benchmarks ray-affinity``: KV-cache-aware routing against round-robin
on Ray Serve (issue 22, acceptance 2), in one interleaved run.

A local Ray cluster of 3 nodes (``ray.cluster_utils.Cluster``, one CPU each)
runs 3 pagedserve replicas, each a whole engine with the SIMULATED worker in
real time (PAGEDSERVE_SIM_TIME_SCALE=1: every step lasts its modelled time
on OPT-13B / A100-40GB; no model runs, so all figures are SIMULATED). The
workload: ``--users`` users each keep a growing conversation of ``--turns``
turns (each turn's prompt = the previous prompt + the previous answer's
token ids + a new user message: multi-turn chat at the token level, so the
prefix is exact), streamed through the OpenAI ingress. Reported per router:
prefix-cache hit rate (the replicas' vllm:prefix_cache_hits / queries),
TTFT p50 / p99, output throughput, and requests lost. ``--kill`` kills one
replica mid-run in the KV-affinity runs (Ray restarts it; the ingress
resumes its requests elsewhere).

    pip install 'pagedserve[ray]'
    python -m benchmarks ray-affinity [--rounds 1] [--users 30] [--turns 4] [--kill]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import threading
import time
import urllib.request
from datetime import datetime, timezone
from typing import Any

from pagedserve.bench.serve_proc import free_port

SERVE_ARGS = ["--worker", "sim", "--num-gpu-blocks", "4096", "--max-model-len", "16384", "--max-num-seqs", "16"]
SIM_ENV = {"PAGEDSERVE_SIM_TIME_SCALE": "1"}


def _stream(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                       "stream": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft: float | None = None
    ids: list[int] = []
    last: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            got = obj["choices"][0]["token_ids"]
            if got and ttft is None:
                ttft = time.monotonic() - t0
            ids += got
            if "pagedserve" in obj:
                last = obj["pagedserve"]
    return {"ttft": ttft if ttft is not None else time.monotonic() - t0, "ids": ids, "end": time.monotonic(),
            "replica": last.get("replica"), "prefix_cache": last.get("prefix_cache"),
            "resumed": last.get("resumed", 0)}


def run_workload(url: str, users: int, turns: int, seed: int, kill: Any = None, opening: int = 3000,
                 message: int = 100, answer: int = 32) -> dict[str, Any]:
    """Each user: an ``opening``-token first prompt (their own system prompt and question), then per
    turn the answer's token ids and a new ``message``-token message; answers of ``answer`` tokens;
    users start 0.2 s apart."""
    rng = random.Random(seed)
    openings = [[rng.randrange(1000, 40000) for _ in range(opening)] for _ in range(users)]
    messages = [[[rng.randrange(1000, 40000) for _ in range(message)] for _ in range(turns)] for _ in range(users)]
    results: list[dict[str, Any]] = []
    lost: list[str] = []
    lock = threading.Lock()

    def user(u: int) -> None:
        time.sleep(0.2 * u)
        history = list(openings[u])
        for t in range(turns):
            try:
                r = _stream(url, history, answer)
            except Exception as e:  # noqa: BLE001 - a lost request is counted, not raised
                with lock:
                    lost.append(f"user {u} turn {t}: {type(e).__name__}: {e}")
                return
            r["turn"] = t
            with lock:
                results.append(r)
            history += r["ids"] + messages[u][t]  # the conversation grows by the answer and a new message

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    if kill is not None:
        time.sleep(0.2 * users / 2)
        kill()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    hits = queries = 0.0
    latest: dict[str, tuple[float, list[float]]] = {}
    for r in results:  # each replica's counters as of its last answer
        if r["replica"] and r["prefix_cache"] and r["end"] >= latest.get(r["replica"], (0.0, []))[0]:
            latest[r["replica"]] = (r["end"], r["prefix_cache"])
    for _, (h, q) in latest.values():
        hits, queries = hits + h, queries + q
    ttfts = sorted(r["ttft"] for r in results)
    return {"requests": len(results), "lost": lost, "wall_s": round(wall, 2),
            "throughput_tok_s": round(sum(len(r["ids"]) for r in results) / wall, 1),
            "ttft_p50_s": round(statistics.median(ttfts), 4),
            "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 4),
            "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0, "replicas_seen": len(latest),
            "resumed_requests": sum(1 for r in results if r["resumed"]),
            "ttft_max_by_turn_s": [round(max((r["ttft"] for r in results if r["turn"] == t), default=0.0), 3)
                                   for t in range(turns)]}


def _replica_actors() -> list[dict[str, str]]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if "SERVE_REPLICA" in a["name"] and "PagedServeReplica" in a["name"]]


def _kill_one_replica() -> None:
    import ray

    victim = _replica_actors()[0]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=False)  # a crash


def _wait_replaced(before: set[str], timeout_s: float = 300.0) -> bool:
    """Serve's controller has started a replica in the killed one's place (3 running, one new)."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = {a["name"] for a in _replica_actors()}
        dep = serve.status().applications["pagedserve"].deployments["PagedServeReplica"]
        if len(names) == 3 and names - before and dep.replica_states.get("RUNNING", 0) == 3:
            return True
        time.sleep(1.0)
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks ray-affinity", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of (round-robin, kv)")
    p.add_argument("--users", type=int, default=30)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--opening", type=int, default=3000, help="tokens of each user's first prompt")
    p.add_argument("--kill", action="store_true", help="also kill a replica mid-run in a kv run")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from pagedserve.rayserve.app import build_app

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="ERROR")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    plan = [r for _ in range(args.rounds) for r in ("round-robin", "kv")] + (["kv-kill"] if args.kill else [])
    runs: list[dict[str, Any]] = []
    try:
        for i, name in enumerate(plan):
            router = "kv" if name.startswith("kv") else name
            app = build_app(None, SERVE_ARGS, 3, router, env=SIM_ENV)
            serve.run(app, name="pagedserve", route_prefix="/")
            before = {a["name"] for a in _replica_actors()}
            res = run_workload(url, args.users, args.turns, seed=i // 2, opening=args.opening,
                               kill=_kill_one_replica if name == "kv-kill" else None)
            res["router"] = name
            if name == "kv-kill":
                res["replica_replaced"] = _wait_replaced(before)
            runs.append(res)
            print(json.dumps(res), flush=True)
            serve.delete("pagedserve")
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    out = {"what": "SIMULATED (cost model OPT-13B/A100, real-time sim worker): KV-affinity vs round-robin routing "
                   "on Ray Serve, 3 replicas on a 3-node local Ray cluster",
           "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "users": args.users, "turns": args.turns, "opening_tokens": args.opening, "runs": runs}
    rr = [r for r in runs if r["router"] == "round-robin"]
    kv = [r for r in runs if r["router"] == "kv"]
    if rr and kv:
        med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
        out["ratios_kv_over_rr"] = {k: round(med(kv, k) / med(rr, k), 3) if med(rr, k) else None
                                    for k in ("prefix_hit_rate", "ttft_p50_s", "ttft_p99_s", "throughput_tok_s")}
        print("kv / round-robin:", json.dumps(out["ratios_kv_over_rr"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
