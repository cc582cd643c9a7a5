"""The multi-turn chat client of issue 42's benchmarks, apart from what serves it (Ray's
ingress in ray_multiturn.py, the Kubernetes picker in kube_multiturn.py): USERS users, each
with a distinct system prompt of LO-HI tokens and TURNS growing turns (the conversation so
far, then a new question), ANSWER tokens per answer (greedy, ignore_eos), all users at once,
each turn streamed (chat completions over HTTP, aiohttp). Per run: TTFT p50/p99, output tokens
per second, lost requests (an error status, an error event, or no [DONE]), and the prefix-cache
hit rate from ``vllm:prefix_cache_{hits,queries}_total`` scraped from the engines' /metrics
(``counters``: which engine each sample is; the run counts what grew from its start)."""
from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

WORDS = ("river stone cloud lantern harbor meadow copper violet engine orchard signal canyon ember willow "
         "market thunder glacier compass velvet summit beacon quarry meadow falcon prism cedar tundra archive "
         "saffron delta marble voyage plume cobalt fable ridge ivory juniper nectar obsidian").split()
QUESTIONS = ["Summarize the rules above in one sentence.", "What should I check first?",
             "Give me one more example.", "What is the most common mistake?", "Explain that differently.",
             "Which rule matters most, and why?"]
POD_HEADER = "x-picker-pod"  # the Kubernetes picker names the pod that answered


def system_prompt(tok: Any, user: int, lo: int, hi: int) -> str:
    rng = random.Random(user)
    target = rng.randint(lo, hi)
    text = f"You are assistant number {user}. Follow these house rules carefully."
    while len(tok.encode(text)) < target:
        text += " Rule: " + " ".join(rng.choice(WORDS) for _ in range(12)) + "."
    return text


async def turn(session: Any, url: str, messages: list[dict[str, str]], answer: int) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": answer, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    out: dict[str, Any] = {"start": t0, "ttft": None, "tokens": 0, "text": "", "ok": False}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            out["pod"] = resp.headers.get(POD_HEADER)
            if resp.status != 200:
                out["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    data = ev.decode().removeprefix("data: ")
                    if data == "[DONE]":
                        out["ok"] = "error" not in out
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        out["error"] = obj["error"].get("message")
                        continue
                    for ch in obj.get("choices") or ():
                        piece = (ch.get("delta") or {}).get("content")
                        if piece and out["ttft"] is None:
                            out["ttft"] = time.monotonic() - t0
                        out["text"] += piece or ""
                    if obj.get("usage"):
                        out["tokens"] = obj["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - a lost request, counted as such
        out["error"] = f"{type(e).__name__}: {e}"
    out["end"] = time.monotonic()
    return out


async def user(session: Any, url: str, system: str, uid: int, turns: int, answer: int,
               results: list[dict[str, Any]]) -> None:
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[(uid + t) % len(QUESTIONS)]})
        r = await turn(session, url, messages, answer)
        r.update(user=uid, turn=t)
        results.append(r)
        messages.append({"role": "assistant", "content": r["text"] or "(no answer)"})


def prefix_counters(text: str, label: str | None = None) -> dict[str, tuple[float, float]]:
    """engine -> (hits, queries) from a /metrics text: by the ``label`` of each sample (Ray's
    ingress: ``replica``), or, with no label, the whole text as one engine ("")."""
    got: dict[str, list[float]] = {}
    for m in re.finditer(r'^vllm:prefix_cache_(hits|queries)_total(?:\{([^}]*)\})? ([0-9.e+]+)$', text, re.M):
        key = ""
        if label is not None:
            rep = re.search(label + r'="([^"]+)"', m.group(2) or "")
            if not rep:
                continue
            key = rep.group(1)
        acc = got.setdefault(key, [0.0, 0.0])
        acc[0 if m.group(1) == "hits" else 1] += float(m.group(3))
    return {k: (v[0], v[1]) for k, v in got.items()}


Counters = Callable[[Any], Awaitable[dict[str, tuple[float, float]]]]


async def run_once(url: str, systems: list[str], turns: int, answer: int, counters: Counters,
                   kill: Any = None, extra: Callable[[list[dict[str, Any]], float], dict[str, Any]] | None = None
                   ) -> dict[str, Any]:
    """One run of every user against ``url``. ``counters(session)``: each engine's prefix-cache
    counters now (scraped every 2 s and at the end, so an engine that goes away keeps its last).
    ``extra(results, t0)``: more fields from the per-request records (the Ray benchmark's trace)."""
    import aiohttp

    results: list[dict[str, Any]] = []
    seen: dict[str, tuple[float, float]] = {}
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def scrape() -> None:
            seen.update(await counters(session))

        async def scraper() -> None:
            while True:
                await asyncio.sleep(2)
                try:
                    await scrape()
                except Exception:  # noqa: BLE001 - the next scrape counts
                    pass

        async def killer() -> None:
            total = len(systems) * turns
            while sum(1 for r in results if "end" in r) < total // 3:
                await asyncio.sleep(0.2)
            await asyncio.to_thread(kill)

        await scrape()
        start = dict(seen)
        t0 = time.monotonic()
        bg = [asyncio.create_task(scraper())] + ([asyncio.create_task(killer())] if kill else [])
        await asyncio.gather(*(user(session, url, s, i, turns, answer, results) for i, s in enumerate(systems)))
        wall = time.monotonic() - t0
        for t in bg:
            t.cancel()
        await scrape()
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    hits = sum(h - start.get(k, (0.0, 0.0))[0] for k, (h, _) in seen.items())
    queries = sum(q - start.get(k, (0.0, 0.0))[1] for k, (_, q) in seen.items())
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) >= 2 else ttfts * 99
    pods: dict[str, int] = {}
    for r in results:
        if r.get("pod"):
            pods[r["pod"]] = pods.get(r["pod"], 0) + 1
    return {"requests": len(results), "lost": [r.get("error", "no [DONE]") for r in results if not r["ok"]],
            "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_p99_s": round(q[98], 3) if ttfts else None,
            "output_tok_s": round(sum(r["tokens"] for r in results) / wall, 2), "wall_s": round(wall, 1),
            "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0, "engines_seen": len(seen),
            "answered_by": pods,  # by the picker's x-picker-pod header (none through Ray's ingress)
            "users_on_one_pod": sum(len({r.get("pod") for r in results if r["user"] == u}) == 1
                                    for u in range(len(systems))) if pods else None,
            **(extra(results, t0) if extra else {})}


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("prefix_hit_rate", "ttft_p50_s", "ttft_p99_s", "output_tok_s")
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"lost": sum(len(r["lost"]) for r in runs)}
