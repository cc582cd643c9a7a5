"""Multi-turn chat through `pagedserve ray-serve`, KV-aware routing against
round-robin (issue 42, acceptance 2 and 3).

    python benchmarks/ray_multiturn.py --rounds 3 --kill --out docs/results/ray-multiturn.json
    (or `python -m benchmarks ray-multiturn ...`; Ray venv: scripts/setup-ray.sh)

The embedded model (SmolLM2-135M-Instruct, real forward passes on CPU), 3
replicas on a local 3-node ``ray.cluster_utils.Cluster``, behind the ingress.
The client: USERS users, each with a distinct system prompt of 600-1,000
tokens and TURNS growing turns (the conversation so far, then a new question),
ANSWER tokens per answer (greedy, ignore_eos), all users at once, each turn
streamed (chat completions over HTTP, aiohttp). Per run: TTFT p50/p99, output
tokens per second, the prefix-cache hit rate (the replicas' vllm:prefix_cache
counters on the ingress's /metrics, per replica label, so a replaced replica's
counts are kept), lost requests (an error status, an error event, or no
[DONE]). Each run starts from fresh replicas (empty caches); routers are
interleaved round by round, and the table is the median of the rounds. With
``--kill``, one more KV run in which a replica's actor is killed (ray.kill)
once a third of the requests have finished: its TTFT p50 against the median of
the undisturbed KV runs, and 0 lost (streams resume on another replica).

--out gets the machine, the date, the baseline, each run's figures with every
request's record (user, turn, TTFT, and from the router's trace,
the router's ``trace`` file: its replica, why, its prefix hit, the router's costs
then, and what the client had outstanding on that replica), the medians, and
the verdicts computed from them: kv ahead on hit rate, TTFT p50, TTFT p99 and
output tok/s (acceptance 2), and for --kill, 0 lost and p50 within 2x
(acceptance 3)."""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.multiturn_client import QUESTIONS, median_row, prefix_counters, system_prompt
from benchmarks.multiturn_client import run_once as client_run_once

SERVE_ARGS = ["--max-model-len", "4096", "--num-gpu-blocks", "1024", "--max-num-seqs", "16"]


def first_hashes(tok: Any, systems: list[str], block_size: int = 16) -> dict[int, int]:
    """Each user's first block hash (the ingress's: the chat template over the system prompt): user by hash."""
    from pagedserve.common.block_hash import prompt_block_hashes

    out = {}
    for u, s in enumerate(systems):
        ids = tok.apply_chat_template([{"role": "system", "content": s}, {"role": "user", "content": QUESTIONS[0]}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        out[prompt_block_hashes(list(ids), block_size)[0]] = u
    return out


def join_trace(results: list[dict[str, Any]], lines: list[str], users: dict[int, int], t0: float) -> list[dict]:
    """Per request: who, when (s from the run's start), TTFT, and where the router sent it (its first routing
    within its lifetime: a retry or a resumed stream routes again, counted in "rerouted"), with its hit, the
    router's view then, and the requests the client had outstanding on that replica when it was routed (the
    trace's clock is the benchmark's: CLOCK_MONOTONIC, one machine)."""
    events: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        ev = json.loads(line)
        u = users.get(ev.get("h0"))
        if u is not None:
            events.setdefault(u, []).append(ev)
    out = []
    for r in results:
        end = r.get("end", r["start"])
        mine = [e for e in events.get(r["user"], ()) if r["start"] <= e["t"] <= end]
        routed = [e for e in mine if e["ev"] == "routed"]
        ev = routed[0] if routed else None
        views = [e for e in mine if e["ev"] == "choose" and ev and e.get("n") == ev["n"] and e["t"] <= ev["t"]]
        view = views[-1] if views else None
        out.append({"user": r["user"], "turn": r["turn"], "start": round(r["start"] - t0, 2),
                    "end": round(end - t0, 2), "ttft": None if r["ttft"] is None else round(r["ttft"], 3),
                    "replica": ev["replica"] if ev else None, "t_routed": round(ev["t"] - t0, 2) if ev else None,
                    "reason": ev["reason"] if ev else None, "hit": ev["hit"] if ev else None,
                    "blocks": ev["n"] if ev else None, "rerouted": max(0, len(routed) - 1),
                    **{k: view[k] for k in ("view", "costs", "requests") if view and k in view}})
    for q in out:  # what was outstanding on its replica when it was routed
        if q["t_routed"] is None:
            continue
        ahead = [o for o in out if o is not q and o["replica"] == q["replica"] and o["t_routed"] is not None
                 and o["t_routed"] <= q["t_routed"] < o["end"]]
        q["outstanding"] = len(ahead)
        q["outstanding_miss_blocks"] = sum(o["blocks"] - (o["hit"] or 0) for o in ahead)
    return out


async def run_once(url: str, systems: list[str], turns: int, answer: int,
                   kill: Any = None, trace: tuple[Path, dict[int, int]] | None = None) -> dict[str, Any]:
    """The shared client's run through the ingress: its counters per replica label, and each
    request's routing from the router's trace."""
    async def counters(session: Any) -> dict[str, tuple[float, float]]:
        async with session.get(url + "/metrics") as r:
            return prefix_counters(await r.text(), "replica")

    def per_request(results: list[dict[str, Any]], t0: float) -> dict[str, Any]:
        lines = trace[0].read_text().splitlines() if trace and trace[0].exists() else []
        return {"per_request": join_trace(results, lines, trace[1], t0) if trace else []}

    out = await client_run_once(url, systems, turns, answer, counters, kill, per_request)
    out["replicas_seen"] = out.pop("engines_seen")
    return out


def kill_one_replica() -> str:
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        if "#PagedServeReplica#" in a["name"]:
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]))
            return a["name"]
    return ""


def wait_healthy(url: str, n: int, timeout_s: float = 1800) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=30) as r:
                h = json.load(r)
            if sum(x["healthy"] for x in h["replicas"]) >= n or h["replica_states"].get("RUNNING", 0) >= n:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1)
    raise TimeoutError(f"{n} healthy replicas after {timeout_s} s")


def slowest(per_request: list[dict[str, Any]], k: int = 4) -> list[dict[str, Any]]:
    return sorted((q for q in per_request if q["ttft"] is not None), key=lambda q: -q["ttft"])[:k]


def machine() -> dict[str, Any]:
    import os
    import platform

    return {"host": platform.node(), "cpus": os.cpu_count(), "load_avg_at_start": [round(x, 2) for x in
                                                                                  os.getloadavg()],
            "python": platform.python_version()}


def summarize(runs: list[dict[str, Any]], routers: list[str], kill: bool) -> dict[str, Any]:
    """The medians per router, and each acceptance verdict computed from them (issue 42: 2 and 3)."""
    table = {name: median_row([r for r in runs if r["router"] == name]) for name in routers}
    out: dict[str, Any] = {"baseline": "round-robin (RoundRobinRouter) on the same cluster and client, "
                                       "interleaved with kv", "runs": runs, "median": table, "verdicts": {}}
    v = out["verdicts"]
    if {"kv", "round-robin"} <= table.keys():
        kv, rr = table["kv"], table["round-robin"]
        v["kv_ahead_on_hit_rate"] = kv["prefix_hit_rate"] > rr["prefix_hit_rate"]
        v["kv_ahead_on_ttft_p50"] = kv["ttft_p50_s"] < rr["ttft_p50_s"]
        v["kv_ahead_on_ttft_p99"] = kv["ttft_p99_s"] < rr["ttft_p99_s"]
        v["kv_ahead_on_output_tok_s"] = kv["output_tok_s"] > rr["output_tok_s"]
        v["acceptance_2"] = all(v[k] for k in list(v)) and kv["lost"] == 0 and rr["lost"] == 0
    if kill:
        [k] = [r for r in runs if r["router"] == "kv-kill"]
        ratio = round(k["ttft_p50_s"] / table["kv"]["ttft_p50_s"], 2) if k["ttft_p50_s"] else None
        out["kill"] = {"lost": len(k["lost"]), "ttft_p50_s": k["ttft_p50_s"], "ttft_p50_vs_undisturbed": ratio}
        v["kill_lost_0"] = len(k["lost"]) == 0
        v["kill_ttft_p50_within_2x"] = ratio is not None and ratio <= 2.0
        v["acceptance_3"] = v["kill_lost_0"] and v["kill_ttft_p50_within_2x"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ray-multiturn", description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--answer", type=int, default=24, help="tokens per answer")
    p.add_argument("--system-tokens", default="600-1000", help="LO-HI tokens of each user's system prompt")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--routers", default="kv,round-robin")
    p.add_argument("--kill", action="store_true", help="one more KV run with a replica killed mid-run")
    p.add_argument("--out", default=None, help="write the results here (JSON)")
    p.add_argument("serve_args", nargs="*", help=f"after --: each replica's serve flags (default {SERVE_ARGS})")
    args = p.parse_args(argv)
    import os

    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from transformers import AutoTokenizer

    from pagedserve.common.default_model import resolve_model
    from pagedserve.rayserve.app import build_app
    from pagedserve.rayserve.engine import free_port

    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # a shared machine: no OOM killer on replicas
    trace_file = Path(tempfile.mkdtemp(prefix="pagedserve-ray-bench-")) / "router-trace.jsonl"
    lo, hi = (int(x) for x in args.system_tokens.split("-"))
    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    systems = [system_prompt(tok, u, lo, hi) for u in range(args.users)]
    users = first_hashes(tok, systems)
    routers = args.routers.split(",")
    started = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine()}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="ERROR")
    port = free_port("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    plan = [(r, router) for r in range(args.rounds)
            for router in (routers if r % 2 == 0 else routers[::-1])]  # interleaved, alternating order
    if args.kill:
        plan.append((args.rounds, "kv-kill"))
    runs: list[dict[str, Any]] = []
    try:
        for rnd, name in plan:
            router = "kv" if name == "kv-kill" else name
            serve.run(build_app(None, args.serve_args or SERVE_ARGS, args.replicas, router,
                                replica_cpus=args.nodes / args.replicas, trace=str(trace_file)),
                      name="pagedserve", route_prefix="/")
            wait_healthy(url, args.replicas)
            trace_file.write_text("")
            res = asyncio.run(run_once(url, systems, args.turns, args.answer,
                                       kill_one_replica if name == "kv-kill" else None, (trace_file, users)))
            res.update(router=name, round=rnd)
            runs.append(res)
            print(json.dumps({k: v for k, v in res.items() if k not in ("lost", "per_request")}
                             | {"lost": len(res["lost"])}), flush=True)
            print("  slowest:", json.dumps(slowest(res["per_request"])), flush=True)
            serve.delete("pagedserve")
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(trace_file.parent, ignore_errors=True)
    out = summarize(runs, routers, args.kill) | started
    out["config"] = vars(args) | {"serve_args": args.serve_args or SERVE_ARGS}
    print(json.dumps(out["median"]), json.dumps(out.get("kill")), json.dumps(out["verdicts"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
