"""The KV-aware routing decision, apart from Ray (router.py wraps it; tests/test_ray_units.py drives it
in-process, without Ray).

Load is counted here, exactly: each request this router sent, from its choice until its response ended
(Serve's on_request_completed), per replica, as requests and as the prefill it brought there (its prompt
blocks that replica did not hold), less the blocks the replica's reports have since shown cached (its
engine stores a block's KV event once the block is computed: that prefill is done). The replicas'
in-flight counts are not used: they lag by up to a stats period, and letting a report replace the count
of what was sent since let a burst of cold first turns pile onto one replica.

The choice minimises an estimate of the wait for the first token, in blocks of prefill: the work queued on
the replica (the uncached blocks of its requests in flight, plus ``decode_blocks`` for each, the steps it
shares with them), plus what this prompt adds there (its blocks past that replica's prefix hit). So a
prefix hit wins while the replica holding it is not busier than recomputing the prompt elsewhere would
cost, a short hit loses to load, and a prompt that hits nowhere (a first turn) goes where the least
prefill waits, not merely where the fewest requests are. A replica with more than ``imbalance`` requests
beyond the least busy one's is chosen only if nothing else is usable (many cheap requests still cost
steps). Ties: the longer hit, the fewer requests, the replica id: every choice is exact and repeatable."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

SPECULATIVE_TTL_S = 5.0  # a prompt just routed counts as cached there until the replica's report shows it
FLIGHT_TTL_S = 1800.0  # a request whose end was never reported is dropped (a bound; Serve reports every end)
CHOSEN_TTL_S = 30.0  # a choice Serve never confirmed (the request was cancelled while Serve probed the replica)
DECODE_BLOCKS = 2  # a request in flight slows each of its replica's steps: its weight, in blocks of prefill
IMBALANCE = 8
MAX_RECENT = 100_000


def match(cached: set[int], recent: dict[int, float], hashes: list[int], now: float) -> int:
    """Leading blocks of the prompt a replica holds (``cached``: its last report) or was just sent
    (``recent``: hash -> when, for SPECULATIVE_TTL_S)."""
    n = 0
    for h in hashes:
        t = recent.get(h)
        if h not in cached and (t is None or now - t > SPECULATIVE_TTL_S):
            break
        n += 1
    return n


@dataclass
class Flight:
    replica: str
    pending: list[int]  # the blocks it brought to prefill there, until a report shows them computed
    at: float
    sent: bool = False  # Serve confirmed it (on_request_routed): it stays until its response ends

    def waiting(self, cached: set[int] | None) -> int:
        if cached is not None and self.pending:
            self.pending = [h for h in self.pending if h not in cached]
        return len(self.pending)


@dataclass
class Choice:
    ranked: list[str]  # replica ids, the chosen one first, then the rest by cost (Serve takes the next if full)
    reason: str  # prefix_hit: the chosen one holds the longest prefix; least_loaded: nobody holds one;
    # fallback: one that holds a longer prefix was busier than recomputing it here
    hit: int  # the chosen replica's prefix hit, in blocks
    costs: dict[str, int] = field(default_factory=dict)  # replica -> estimated wait (blocks), for the trace


class Affinity:
    def __init__(self, imbalance: int = IMBALANCE, decode_blocks: int = DECODE_BLOCKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.imbalance = imbalance
        self.decode_blocks = decode_blocks
        self._clock = clock
        self.flights: dict[str, Flight] = {}  # request id -> its request, chosen and not finished
        self._recent: dict[str, dict[int, float]] = {}  # replica -> hash -> routed at

    # ------------------------------------------------------------ load
    def load(self, replica: str, cached: set[int] | None = None) -> tuple[int, int]:
        """(prefill blocks still to compute there plus ``decode_blocks`` per request, requests) in flight;
        ``cached``: the replica's last report."""
        blocks = reqs = 0
        for f in self.flights.values():
            if f.replica == replica:
                blocks += f.waiting(cached) + self.decode_blocks
                reqs += 1
        return blocks, reqs

    def hit(self, replica: str, cached: set[int], hashes: list[int]) -> int:
        return match(cached, self._recent.get(replica, {}), hashes, self._clock())

    def _send(self, key: str | None, replica: str, hit: int, hashes: list[int], now: float) -> None:
        if key is not None:
            self.flights[key] = Flight(replica, hashes[hit:], now)
        if hashes:
            recent = self._recent.setdefault(replica, {})
            for h in hashes:
                recent[h] = now
            if len(recent) > MAX_RECENT:  # forget the oldest half
                for h, _ in sorted(recent.items(), key=lambda kv: kv[1])[: len(recent) // 2]:
                    del recent[h]

    def routed(self, key: str, replica: str, hashes: list[int], cached: set[int]) -> None:
        """Where Serve sent it: the chosen replica, or the next when that one was full (then it moves)."""
        f = self.flights.get(key)
        if f is None or f.replica != replica:
            now = self._clock()
            self._send(key, replica, match(cached, self._recent.get(replica, {}), hashes, now), hashes, now)
        self.flights[key].sent = True

    def finished(self, key: str) -> None:
        self.flights.pop(key, None)

    def forget(self, replica: str) -> None:
        """The replica died: the ingress retries or resumes its requests elsewhere (routed again)."""
        self._recent.pop(replica, None)
        for k in [k for k, f in self.flights.items() if f.replica == replica]:
            del self.flights[k]

    # ------------------------------------------------------------ choice
    def choose(self, replicas: Iterable[tuple[str, set[int]]], hashes: list[int], key: str | None = None) -> Choice:
        """``replicas``: (id, its reported cached blocks) of those usable. The request (``key``) counts on the
        chosen one at once, and its blocks as cached there, so the next choice sees it."""
        now = self._clock()
        for k in [k for k, f in self.flights.items()
                  if now - f.at > (FLIGHT_TTL_S if f.sent else CHOSEN_TTL_S) or k == key]:
            del self.flights[k]  # and this request's own, when Serve asks again (the chosen one was full)
        rows = []
        for rid, cached in replicas:
            got = match(cached, self._recent.get(rid, {}), hashes, now) if hashes else 0
            blocks, reqs = self.load(rid, cached)
            rows.append((blocks + len(hashes) - got, -got, reqs, rid))
        if not rows:
            return Choice([], "least_loaded", 0)
        least = min(r[2] for r in rows)
        rows.sort(key=lambda r: (r[2] > least + self.imbalance, r))  # the overloaded last, whatever they hold
        cost, neg_hit, _, best = rows[0]
        longest = max(-r[1] for r in rows)
        reason = "least_loaded" if longest == 0 else "prefix_hit" if -neg_hit == longest else "fallback"
        self._send(key, best, -neg_hit, hashes, now)
        return Choice([r[3] for r in rows], reason, -neg_hit, {r[3]: r[0] for r in rows})
