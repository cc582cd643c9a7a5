"""What the ingress knows of the replicas, for its /health and /metrics.

The request router runs in the ingress's process (Ray Serve routes in the
caller of a deployment handle), so the routers register here and the ingress
reads their view: each replica's last routing stats (healthy, load, cached
blocks, the engine's address). /metrics is each replica's engine metrics with
a ``replica`` label on every sample, then the router's and the ingress's own
families (a registry of their own, in this process)."""
from __future__ import annotations

import asyncio
import json
import re
import time
import weakref
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

REGISTRY = CollectorRegistry()
ROUTED = Counter("pagedserve_router_requests", "Requests routed, by why this replica: prefix_hit (it holds the "
                 "longest cached prefix), least_loaded (nobody holds one), fallback (the one that holds it was "
                 "overloaded or full), round_robin", ["reason"], registry=REGISTRY)
HIT_BLOCKS = Histogram("pagedserve_router_prefix_hit_blocks", "Leading prompt blocks the chosen replica holds, "
                       "as the router sees it", buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
                       registry=REGISTRY)
RETRIES = Counter("pagedserve_ingress_retries", "Requests sent again to another replica: the first failed before "
                  "its response began", registry=REGISTRY)
RESUMED = Counter("pagedserve_ingress_resumed_streams", "Streams resumed on another replica after theirs died "
                  "mid-stream", registry=REGISTRY)
BROKEN = Counter("pagedserve_ingress_broken_responses", "Responses cut by a replica's failure mid-stream",
                 registry=REGISTRY)
UNROUTABLE = Counter("pagedserve_router_skipped_replicas", "Times a replica was left out of a choice: unhealthy "
                     "or its stats stale", ["replica"], registry=REGISTRY)

_routers: weakref.WeakSet[Any] = weakref.WeakSet()
SCRAPE_TIMEOUT_S = 5.0
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{)?")


def trace(path: str | None, event: dict[str, Any]) -> None:
    """Appends one routing event (with this process's monotonic clock, the benchmark's too) to
    ``path``, the router's ``trace`` (build_app); nothing when it is None."""
    if not path:
        return
    with open(path, "a") as f:  # one write per line, O_APPEND: lines from several routers never interleave
        f.write(json.dumps({"t": time.monotonic(), **event}) + "\n")


def register(router: Any) -> None:
    _routers.add(router)


def _replicas() -> list[Any]:
    out: dict[Any, Any] = {}
    for router in list(_routers):
        out.update(router.curr_replicas)
    return list(out.values())


def replica_states() -> list[dict[str, Any]]:
    """Each running replica: healthy (for the router: its engine up, its stats fresh), load, cache, address."""
    out = []
    for r in _replicas():
        stats = r.routing_stats or {}
        usable = all(router.usable(r) for router in list(_routers) if r.replica_id in router.curr_replicas)
        out.append({"replica": r.replica_id.unique_id, "healthy": usable,
                    "in_flight": stats.get("in_flight"), "cached_blocks": len(stats.get("cached_blocks", ())),
                    "http": stats.get("http")})
    return sorted(out, key=lambda x: x["replica"])


def serve_states(app: str, deployment: str) -> dict[str, int]:
    """Serve's count of the deployment's replicas by state (RUNNING, STARTING, RECOVERING, ...)."""
    from ray import serve

    try:
        dep = serve.status().applications[app].deployments[deployment]
    except (KeyError, AttributeError):
        return {}
    return {str(k): int(v) for k, v in dep.replica_states.items()}


def _label(text: str, replica: str) -> list[tuple[str, list[str]]]:
    """(family, its lines) in order, each sample labelled; a family is named by its # HELP / # TYPE."""
    fams: list[tuple[str, list[str]]] = []
    cur: tuple[str, list[str]] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                if cur is None or cur[0] != parts[2]:
                    cur = (parts[2], [])
                    fams.append(cur)
                cur[1].append(line)
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        if cur is None:
            cur = (m.group(1), [])
            fams.append(cur)
        lab = f'replica="{replica}"'
        cur[1].append(line[:m.end()] + lab + "," + line[m.end():] if m.group(2) else
                      line[:m.end()] + "{" + lab + "}" + line[m.end():])
    return fams


async def _scrape(session: Any, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text() if resp.status == 200 else ""


async def metrics_text() -> str:
    import aiohttp

    reps = [s for s in replica_states() if s.get("http")]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as session:
        texts = await asyncio.gather(*(_scrape(session, s["http"]) for s in reps), return_exceptions=True)
    merged: dict[str, list[str]] = {}
    for s, text in zip(reps, texts):
        if isinstance(text, BaseException) or not text:
            continue
        for fam, lines in _label(text, s["replica"]):
            have = merged.setdefault(fam, [])
            have += [x for x in lines if not (x.startswith("#") and x in have)]
    own = generate_latest(REGISTRY).decode()
    return "".join(line + "\n" for lines in merged.values() for line in lines) + own


class StatsAge:
    """When each replica's routing stats last changed, by this process's clock (the replicas' clocks may
    differ): a replica that stops reporting (its actor died or hangs) is left out."""

    def __init__(self) -> None:
        self._seen: dict[Any, tuple[Any, float]] = {}

    def age(self, replica_id: Any, stamp: Any) -> float:
        now = time.monotonic()
        last = self._seen.get(replica_id)
        if last is None or last[0] != stamp:
            self._seen[replica_id] = (stamp, now)
            return 0.0
        return now - last[1]

    def forget(self, replica_id: Any) -> None:
        self._seen.pop(replica_id, None)
